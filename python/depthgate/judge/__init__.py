"""Steps 5 and 6, score and gate: the deterministic oracle, control scoring and the statistical gate.

In subpackages, each imported through its ``__init__`` (its public face), lowest first: ``tables``
(the record schema, frames), ``bounds`` (the slice bounds), ``scoring`` (the oracle), ``sequential``
(levels and looks), ``gate`` (the release gate), ``science`` (position science, controls, A/A noise),
``health`` (serving-path checks, what failed) and ``planning`` (power and simulated releases)."""
