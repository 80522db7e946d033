"""Service logging: what the root logger prints at each level."""

from __future__ import annotations

import logging

import pytest

from services.common.logging import configure_logging


@pytest.fixture
def restore_logging():
    root, httpx = logging.getLogger(), logging.getLogger("httpx")
    saved = (root.handlers[:], root.level, httpx.level)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    httpx.setLevel(saved[2])


def test_info_leaves_out_a_line_per_http_request_and_debug_keeps_it(restore_logging):
    configure_logging("t", "INFO", json=False)
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    assert logging.getLogger("services.rollout").isEnabledFor(logging.INFO)
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    configure_logging("t", "DEBUG", json=False)
    assert logging.getLogger("httpx").isEnabledFor(logging.INFO)


def test_text_lines_carry_the_fields_json_lines_carry(restore_logging, capsys):
    import json

    log = logging.getLogger("services.test")
    fields = {"group": "r/s00001/p003", "finish": {"answer": 7, "deadline": 1}, "slowest_s": 3.2}
    configure_logging("t", "INFO", json=False)
    log.info("group written", extra=fields)
    text = capsys.readouterr().err.strip()
    assert text.endswith('group written group=r/s00001/p003 finish={"answer":7,"deadline":1} slowest_s=3.2')
    configure_logging("t", "INFO", json=True)
    log.info("group written", extra=fields)
    line = json.loads(capsys.readouterr().err)
    assert {k: line[k] for k in fields} == fields


def test_attributes_a_record_factory_adds_to_every_record_are_not_fields(restore_logging, capsys):
    """vLLM installs a record factory that adds `vllm_process_name` to every record once an engine configures
    logging, which is after this module was imported: a worker's lines must not carry it as a field."""
    import json

    plain = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = plain(*args, **kwargs)
        record.added_by_a_library = "MainProcess"
        return record

    log = logging.getLogger("services.test")
    logging.setLogRecordFactory(factory)
    try:
        configure_logging("t", "INFO", json=False)
        log.info("group written", extra={"group": "g1"})
        text = capsys.readouterr().err.strip()
        configure_logging("t", "INFO", json=True)
        log.info("group written", extra={"group": "g1"})
        line = json.loads(capsys.readouterr().err)
    finally:
        logging.setLogRecordFactory(plain)
    assert text.endswith("group written group=g1")
    assert line["group"] == "g1" and "added_by_a_library" not in line
