"""The built-in engine's options: one typed record, every field with its default and a one-line doc.

`create_app(model_dir, EngineOptions(...))` serves with them; `stepline engine`'s command-line options take their
defaults from here, and the launchers' engine spec (stepline.launch.services.EngineSpec) leaves a field it does not
set to this default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["DEFAULT_MAX_BODY_BYTES", "DEFAULT_READ_TIMEOUT", "EngineOptions"]

DEFAULT_MAX_BODY_BYTES = 8 * 2**20  # also the bound of stepline.engine.limits.BoundedBody used alone
DEFAULT_READ_TIMEOUT = 30.0


class EngineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    incremental_streaming: bool = Field(False, description="stream only the new text/ids/logprobs in each chunk "
                                        "(as SGLang's incremental streaming); off: each chunk the whole output so far")
    max_running: int = Field(64, ge=1, description="sequences decoded together in one batch; the rest wait")
    context_length: int | None = Field(None, ge=1, description="prompt + new tokens limit (None: the model's "
                                       "max_position_embeddings)")
    weight_version: str = Field("0", description="the weight_version served at start")
    prefix_cache_mb: float = Field(1024.0, ge=0, description="memory for K/V of finished sequences, reused by "
                                   "prompts that extend them (0: off)")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="weights and K/V dtype; bfloat16 is faster "
                                                  "on CPUs with bf16 units, its logprobs less exact")
    control_token: str | None = Field(None, description="token the control endpoints (pause, abort, weight updates) "
                                      "require; None: open to anyone who can reach the port")
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0, description="largest request body accepted (413 above)")
    read_timeout: float = Field(DEFAULT_READ_TIMEOUT, ge=0.1, description="seconds a client may take to send a "
                                "request's headers, and then its body (408 after)")
