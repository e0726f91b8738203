"""The BFCL harness: the Berkeley Function Calling Leaderboard (v4) tasks, run and scored by bfcl-eval's own code."""
