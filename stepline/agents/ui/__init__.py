"""The UI harness: simulated phone apps whose screen is an accessibility tree rendered as short text."""
