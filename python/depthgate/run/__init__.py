"""Step 4, run: the paired, interleaved, resumable runner, its backends, controls and the prefix-cache
control."""
