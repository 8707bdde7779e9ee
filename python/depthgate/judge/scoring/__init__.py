"""The deterministic oracle that scores one answer against its case: reading an answer's text
(``answer_text``), the MRCR reply check (``mrcr``) and :func:`score_records` over a run's records
(``oracle``). Imports only :mod:`depthgate.judge.tables`.
"""

from __future__ import annotations

from depthgate.judge.scoring.answer_text import answer_line, extract_citations, normalize
from depthgate.judge.scoring.oracle import SCORE_COLUMNS, CaseOracle, Score, score, score_records

__all__ = [
    "SCORE_COLUMNS",
    "CaseOracle",
    "Score",
    "answer_line",
    "extract_citations",
    "normalize",
    "score",
    "score_records",
]
