"""The command line and the commands that drive the pipeline end to end (run, gate, faults, diff)."""
