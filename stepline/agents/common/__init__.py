"""What every harness shares: the episode record, tools, the OpenAI loop, scoring and the CLI contract.

Harnesses import only `stepline.agents.*` and public libraries; nothing here knows about Stepline's services.
"""

from stepline.agents.common.cli import Verdict, failed, run_command, tasks_command, verdict_for, verify_command
from stepline.agents.common.episode import EPISODE_FILE, Episode, EpisodeError, ToolCall, read_episode, write_episode
from stepline.agents.common.loop import (
    EndpointError,
    OpenAIPolicy,
    RawCall,
    Turn,
    final_turn,
    run_episode,
    said,
    tool_turn,
)
from stepline.agents.common.scoring import exact_match, normalize_answer, token_f1
from stepline.agents.common.tools import Tool, ToolError, anthropic_schema, call_tool, openai_schema

__all__ = [
    "EPISODE_FILE", "EndpointError", "Episode", "EpisodeError", "OpenAIPolicy", "RawCall", "Tool", "ToolCall",
    "ToolError", "Turn", "Verdict", "anthropic_schema", "call_tool", "exact_match", "failed", "final_turn",
    "normalize_answer", "openai_schema", "read_episode", "run_command", "run_episode", "tasks_command",
    "said", "token_f1", "tool_turn", "verdict_for", "verify_command", "write_episode",
]
