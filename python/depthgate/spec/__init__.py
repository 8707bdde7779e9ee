"""Step 1, the case: pydantic models of cases, suites, systems, matrices and plans; the built-in
suite generator; deterministic filler; value parsers and path resolution."""
