"""The terminal harness: shell chores in a confined sandbox, spoken to over the Anthropic Messages API."""
