"""The job file of `stepline run`: one typed model per component, composed.

    run_dir = "runs/quickstart"
    [model]     how to build the base model (or `dir` of an existing one)
    [sft]       warm start: expert demonstrations per harness, and [trainer] overrides for the SFT pass
    [services]  the engine (built-in or vLLM, started on the policy; or a running one) and the gateway
    [trainer]   the trainer (`stepline.trainer.config.TrainerConfig`; `stepline run` fills in model_dir/output_dir)
    [pool]      the pool `stepline train` and `stepline replay` read (`stepline run` keeps its own in run_dir)
    [rollout]   the harness mix (`stepline.rollout.config.RolloutConfig`)
    [eval]      the held-out evaluation before and after RL
    [cluster]   `stepline run --ray` only: how many of each part, their Ray resources, the PostgreSQL pool

One loader for `stepline run`, `train`, `replay` and `eval`. Relative paths are resolved against the job
file's folder. Errors name the table and the field (`JobError`: "invalid job file F:\n  trainer.lr: ...").
The [trainer] tables are checked at load field by field (names, types, ranges: `trainer_fields`); the checks
across fields, and those of the fields a command fills in, run when the command builds the whole
`TrainerConfig` (`trainer_config`), in the same format.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, model_validator

from stepline.engine.options import EngineOptions
from stepline.gateway.config import GatewaySettings
from stepline.models import check_vllm_shape
from stepline.rollout.config import RolloutConfig, regular_expression
from stepline.trainer.config import TrainerConfig

__all__ = ["JobConfig", "JobError", "load_job", "trainer_config"]

PATH_FIELDS = ("model_dir", "output_dir")  # [trainer] paths, relative to the job file's folder


class JobError(ValueError):
    """The job file cannot be read or does not validate (the message names the field)."""


def invalid(source: str, exc: ValidationError, prefix: str = "") -> JobError:
    """One error format for every job check: `invalid SOURCE:` then one `  table.field: message` line each."""
    lines = [f"invalid {source}:"]
    lines += [f"  {prefix}{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()]
    return JobError("\n".join(lines))


# TrainerConfig's fields, each with its type and range, all optional, unknown names refused: a [trainer] table
# is checked at load without the fields a command fills in later (model_dir, output_dir, mode, ...)
_OPTIONAL: dict[str, Any] = {name: (Annotated[f.annotation, *f.metadata] if f.metadata else f.annotation, None)
                             for name, f in TrainerConfig.model_fields.items()}
_TrainerFields = create_model("TrainerFields", __config__=ConfigDict(extra="forbid", protected_namespaces=()),
                              **_OPTIONAL)


def trainer_fields(table: dict[str, Any]) -> dict[str, Any]:
    """The table with each value converted to its field's type; ValidationError naming each bad field."""
    return _TrainerFields.model_validate(table).model_dump(exclude_unset=True)


TrainerTable = Annotated[dict[str, Any], BeforeValidator(trainer_fields)]


def trainer_config(table: dict[str, Any], name: str = "trainer", source: str = "job") -> TrainerConfig:
    """The whole TrainerConfig of a [trainer] table (filled in by the command); JobError naming `NAME.field`."""
    try:
        return TrainerConfig.model_validate(table)
    except ValidationError as exc:
        raise invalid(source, exc, f"{name}.") from exc


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    dir: Path | None = Field(None, description="use this model directory instead of building one")
    kind: Literal["tiny", "qwen3-tiny", "smollm2-135m"] = Field(
        "tiny", description="model to build (stepline make-model): a tiny random one, or the pretrained SmolLM2-135M")
    seed: int | None = Field(None, description="seed of the random initialisation (None: the job's seed)")
    hidden_size: int = Field(128, ge=8, description="hidden width of the built model")
    num_layers: int = Field(4, ge=1, description="transformer layers of the built model")
    num_heads: int = Field(4, ge=1, description="attention heads of the built model")
    num_kv_heads: int = Field(2, ge=1, description="key/value heads of the built model")
    vllm_compatible: bool = Field(False, description="build a model vLLM serves (make-model --vllm-compatible: "
                                  "hidden_size / num_heads a head size vLLM's CPU attention supports, e.g. 128 / 2; "
                                  "an untied LM head); smollm2-135m is served as it is")

    @model_validator(mode="after")
    def _vllm_shape(self) -> ModelSection:
        if not self.vllm_compatible or self.dir is not None:
            return self
        if self.kind == "smollm2-135m":
            return self  # pretrained: its shape is its own (head size 64, which vLLM serves)
        check_vllm_shape(self.hidden_size, self.num_heads)
        return self


class SFTSection(_Section):
    demos_per_harness: int = Field(16, ge=0, description="expert demonstrations per harness (0: no warm start)")
    demos: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="demonstrations of the named harnesses instead, e.g. {ui = 32}")
    demo_tasks_matching: dict[str, str] = Field(
        default_factory=dict, description="per harness, a regular expression: its demonstrations come only from the "
                                          "train tasks whose id it matches, e.g. {bfcl = '^(?!multi_turn)'}")
    demo_kinds: dict[str, dict[str, Annotated[int, Field(ge=1)]]] = Field(
        default_factory=dict, description="per harness, {kind = n}: its demonstrations draw a task of a kind n times "
                                          "as likely as one of weight 1 (a module's `tasks --kinds`; kinds left out: "
                                          "weight 1), e.g. {ui = {toggle = 4}}")
    trainer: TrainerTable = Field(default_factory=dict, description="TrainerConfig fields for the SFT pass")


def _engine_default(name: str) -> Any:
    return EngineOptions.model_fields[name].default


def _gateway_default(name: str) -> Any:
    return GatewaySettings.model_fields[name].default


class ServicesSection(_Section):
    """The engine and gateway settings every launcher passes on (stepline.launch.wiring); where the engine or the
    gateway has its own default, the field's default is that one."""

    engine_url: str | None = Field(None, description="use this running engine instead of starting one")
    engine_kind: Literal["builtin", "sglang", "vllm"] = Field(
        "builtin", description="the engine's wire format: of engine_url's engine, else of the one started on the "
        "policy (builtin, or vllm from vllm_python; sglang needs engine_url, or cluster.engine_command under --ray)")
    vllm_python: str | None = Field(None, description="python of the environment with vLLM installed, for "
                                    "engine_kind = vllm (None: $STEPLINE_VLLM_PYTHON)")
    vllm_args: list[str] = Field(default_factory=list, description="more arguments of the vLLM server the job "
                                 "starts, e.g. [\"--max-num-seqs\", \"16\"]")
    vllm_kv_cache_gib: int = Field(1, ge=1, description="KV cache of the vLLM server the job starts, GiB "
                                   "(VLLM_CPU_KVCACHE_SPACE)")
    context_length: int | None = Field(None, ge=1, description="prompt + output token limit of the engine started "
                                       "and of the gateway (None: the model's; the gateway lowers it to the "
                                       "engine's own limit)")
    startup_timeout_s: float = Field(180.0, gt=0, description="seconds each service may take to become healthy")
    session_idle_timeout: float = Field(
        _gateway_default("session_idle_timeout"), gt=0, description="the gateway's: open sessions without a call "
        "for this long end as abandoned, and at start the pool's open sessions created longer ago (those a killed "
        "launcher left behind)")
    responses_truncated: Literal["incomplete", "completed"] = Field(
        _gateway_default("responses_truncated"), description="the gateway's: Responses API answers cut by "
        "max_output_tokens end as OpenAI's (incomplete) or as completed, which the OpenAI Agents SDK accepts")
    max_session_sequences: int = Field(
        _gateway_default("max_session_sequences"), ge=0, description="the gateway's: engine sequences (choices x "
        "prompts) one session may have running at once; its further ones wait their turn (0: no limit)")
    partial_rollouts: bool = Field(
        _gateway_default("partial_rollouts"), description="the gateway's: a call a weight update cut short goes on "
        "under the new weights and is answered whole, each token recorded with the version that sampled it (off: "
        "answered truncated)")
    engine_dtype: Literal["float32", "bfloat16", "auto"] = Field(
        _engine_default("dtype"), description="weights of the built-in engine; auto: bfloat16 where this CPU has "
        "bf16 units and runs bf16 matmuls faster than float32 (timed once)")
    engine_threads: int | None = Field(None, ge=1, description="torch threads of the built-in engine (None: torch's)")
    prefix_cache_mb: float = Field(_engine_default("prefix_cache_mb"), ge=0,
                                   description="built-in engine's prefix cache bound (0: off)")


class PoolSection(_Section):
    url: str = Field("sqlite:///pool.db", description="pool URL of `stepline train`/`replay`: sqlite:///…, "
                     "postgresql://…, http://…")


class EvalSection(_Section):
    limit: int | None = Field(30, ge=1, description="test tasks per harness (None: the whole test split)")
    concurrency: int | None = Field(None, ge=1, description="test episodes running at once (None: the rollouts' "
                                    "max_concurrency); no trainer runs meanwhile, so the engine can batch more")
    every: int | None = Field(None, ge=1, description="also evaluate every k RL updates (None: before and after)")
    temperature: float | None = Field(None, ge=0, le=2, description="sampling temperature of the test episodes "
                                      "(0: greedy; None: the rollouts', [rollout] temperature)")


class PartResources(_Section):
    num_cpus: float = Field(0.0, ge=0, description="CPUs Ray reserves for each such part (0: placed anywhere)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each such part")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources, e.g. a node label")


class ClusterSection(_Section):
    engines: int = Field(1, ge=1, description="engine replicas (built-in, or `engine_command`)")
    gateways: int = Field(1, ge=1, description="gateways; the engines are split evenly among them (each fronts its own share)")
    rollout_workers: int = Field(1, ge=1, description="rollout workers; worker i plays against gateway i mod gateways")
    trainers: int = Field(1, ge=1, description="trainer ranks (data parallel: each forwards its share of every "
                          "update's groups; gloo on CPU, NCCL on GPU)")
    pool_url: str | None = Field(None, description="PostgreSQL pool URL (None: the STEPLINE_PG_URL environment variable)")
    engine_restarts: int = Field(3, ge=0, description="times an engine replica's actor starts its process again "
                                 "when it dies (same address; its gateway loads the current weights into it)")
    namespace: str | None = Field(None, description="Ray namespace of the job's named actors (stepline-engine-0, "
                                  "stepline-rollout-0, ...); None: an anonymous one")
    engine_command: list[str] | None = Field(
        None, description="argv of an external engine (SGLang, vLLM) with {model} {host} {port}; None: built-in")
    engine: PartResources = PartResources()
    gateway: PartResources = PartResources()
    rollout: PartResources = PartResources()
    trainer: PartResources = PartResources()

    @model_validator(mode="after")
    def _engines_split(self) -> ClusterSection:
        if self.engines % self.gateways:
            raise ValueError(f"engines ({self.engines}) must be a multiple of gateways ({self.gateways})")
        return self


class JobConfig(_Section):
    run_dir: Path = Field(Path("runs/job"), description="config, pool, metrics, checkpoints, plot and summary go here")
    seed: int = Field(0, description="seed of the job (model, rollouts, trainer)")
    rl_updates: int = Field(10, ge=0, description="policy updates of the RL phase")
    rl_minutes: float | None = Field(None, gt=0, description="time bound of the RL phase, resumes included: no update "
                                     "starts after it, and the evaluation after RL follows (None: none)")
    job_minutes: float | None = Field(None, gt=0, description="time bound of the whole job, resumes included: the RL "
                                      "phase stops starting updates when what is left would not hold the evaluation "
                                      "after it (timed as 1.5x the one before: a trained policy runs longer episodes); "
                                      "with rl_minutes, the earlier bound wins")
    groups_ahead: int = Field(1, ge=1, description="finished rollout batches that may wait for the trainer")
    max_batches_per_update: int = Field(3, ge=1, description="rollout batches per RL update at most (dynamic sampling "
                                        "draws more when groups have no reward variance); then the job winds down")
    model: ModelSection = ModelSection()
    sft: SFTSection = SFTSection()
    services: ServicesSection = ServicesSection()
    trainer: TrainerTable = Field(default_factory=dict, description="TrainerConfig fields: the RL phase of `stepline "
                                  "run`, the trainer of `stepline train` and `replay`")
    pool: PoolSection = PoolSection()
    rollout: RolloutConfig = RolloutConfig()
    eval: EvalSection = EvalSection()
    cluster: ClusterSection = ClusterSection()

    @model_validator(mode="after")
    def _startable_engine(self) -> JobConfig:
        svc, model = self.services, self.model
        if svc.engine_url is None and svc.engine_kind == "sglang" and self.cluster.engine_command is None:
            raise ValueError("services.engine_kind: a job starts the built-in engine or vLLM; give "
                             "services.engine_url of a running SGLang server (or cluster.engine_command for --ray)")
        if (svc.engine_url is None and svc.engine_kind == "vllm" and model.dir is None and not model.vllm_compatible
                and model.kind != "smollm2-135m"):
            raise ValueError("model.vllm_compatible: the job starts vLLM on the model it builds, so build one vLLM "
                             "can serve (vllm_compatible = true: a head size its CPU attention supports)")
        return self

    @model_validator(mode="after")
    def _per_harness_settings_name_known_harnesses(self) -> JobConfig:
        names = {h.name for h in self.rollout.harnesses}
        for field in ("demos", "demo_tasks_matching", "demo_kinds"):
            if unknown := sorted(set(getattr(self.sft, field)) - names):
                raise ValueError(f"sft.{field}: no harness named {', '.join(map(repr, unknown))} in [[rollout.harnesses]]")
        scale = self.trainer.get("negative_scale")
        if isinstance(scale, dict) and (unknown := sorted(set(scale) - names)):
            raise ValueError(f"trainer.negative_scale: no harness named {', '.join(map(repr, unknown))} in "
                             "[[rollout.harnesses]]")
        for name, pattern in self.sft.demo_tasks_matching.items():
            try:
                regular_expression(pattern)
            except ValueError as exc:
                raise ValueError(f"sft.demo_tasks_matching.{name}: {exc}") from None
        return self


def unused_by_run(cfg: JobConfig, on_ray: bool) -> list[str]:
    """The tables a job file sets that `stepline run` (with or without --ray) does not read, and the settings that
    do nothing in it, each with why."""
    notes = []
    if cfg.trainer.get("expert_sft_coef") and not any(h.expert_per_group for h in cfg.rollout.harnesses):
        notes.append(f"trainer.expert_sft_coef = {cfg.trainer['expert_sft_coef']} trains the experts' episodes of "
                     "training groups, and no harness plays any (rollout.harnesses.N.expert_per_group): it does nothing")
    if "pool" in cfg.model_fields_set:
        notes.append(f"[pool] is read by `stepline train` and `replay`; `stepline run` keeps its pool in "
                     f"{cfg.run_dir / 'pool.db'}" + (" (with --ray: [cluster] pool_url)" if on_ray else ""))
    if "cluster" in cfg.model_fields_set and not on_ray:
        notes.append("[cluster] is read by `stepline run --ray` only")
    return notes


def _override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set `dotted` (e.g. "trainer.lr", or "rollout.harnesses.2.group_size": an index into an array of tables)."""
    *parents, leaf = dotted.split(".")
    table: Any = raw
    for key in parents:
        if isinstance(table, list):
            if not key.isdigit() or int(key) >= len(table):
                raise JobError(f"override {dotted}: {key!r} is not an index of the {len(table)} entries there")
            table = table[int(key)]
        else:
            table = table.setdefault(key, {})
    if not isinstance(table, dict):
        raise JobError(f"override {dotted}: {'.'.join(parents)} is not a table")
    table[leaf] = value


def load_job(path: Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    """Read, resolve relative paths against the file's folder, apply overrides (dotted keys), validate."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise JobError(f"cannot read job file {path}: {exc}") from exc
    for dotted, value in (overrides or {}).items():
        _override(raw, dotted, value)
    base = Path(path).resolve().parent
    raw["run_dir"] = str((base / raw.get("run_dir", "runs/job")).resolve())
    if raw.get("model", {}).get("dir"):
        raw["model"]["dir"] = str(base / raw["model"]["dir"])
    sft = raw.get("sft")
    for trainer in (raw.get("trainer"), sft.get("trainer") if isinstance(sft, dict) else None):
        for key in PATH_FIELDS:
            if isinstance(trainer, dict) and isinstance(trainer.get(key), str):  # else validation names it
                trainer[key] = str(base / trainer[key])  # an absolute path stays as it is
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise invalid(f"job file {path}", exc) from exc
