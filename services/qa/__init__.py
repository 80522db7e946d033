"""Out-of-domain QA (paper Table 2): a dense `Search(query)` tool over a local passage corpus, the
seven QA sets' loaders, exact match / F1 with SQuAD normalisation, and the search-agent prompt.

Spec: ../shared/spec/paper-recipe.md (Evaluation, OOD), agent-star.md §6.2. In-domain
(TravelPlanner) and OOD results are reported apart, never mixed.
"""
