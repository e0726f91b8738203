"""The trainer's configuration: one typed model, every field defaulted and documented, checked at load.

Errors name the field (pydantic's ValidationError carries its location), and everything that can be
checked before the run starts is: algorithm names against the registries of `stepline.trainer.algorithms`,
their hyper-parameters against the functions' signatures, batch-size divisibility, ranges, the model
directory. Components never receive this object: the loop hands them plain values.
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from stepline.modeldir import model_dir_problem

__all__ = ["TrainerConfig"]

UnitInterval = Annotated[float, Field(ge=0, le=1)]


class TrainerConfig(BaseModel):
    """The [trainer] table of a job file."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # --- what to train, where to write ---
    model_dir: Path = Field(Path("model"), description="Hugging Face model directory to start from")
    output_dir: Path = Field(Path("runs/train"), description="checkpoints, pushed weights and logs go here")
    mode: Literal["rl", "sft"] = Field("rl", description="rl: policy optimisation; sft: cross-entropy warm start")
    consumer: str = Field("trainer", description="name under which this trainer claims groups from the pool")
    seed: int = Field(0, description="seed of torch/numpy/python RNGs")
    device: str = Field("auto", description="torch device: auto (cuda if available) | cpu | cuda | cuda:N")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="parameter dtype of the policy")
    attn_implementation: Literal["sdpa", "eager"] = Field("sdpa", description="HF attention for the tree mask")

    # --- what trains, and how fast (see stepline/trainer/trainable.py) ---
    autocast_bf16: bool | Literal["auto"] = Field(
        False, description="forward and backward under bf16 autocast (CPU or GPU); weights, gradients and AdamW state "
                           "stay fp32 (needs dtype float32); \"auto\": only where bf16 is fast (a CPU with "
                           "AVX512-BF16 or AMX, a bf16 GPU; see stepline/trainer/precision.py)")
    train_layers: int | None = Field(None, ge=1, description="train only the top k transformer layers and the final "
                                     "norm; the embedding and the LM head (one tied matrix in tiny and SmolLM2) and "
                                     "all lower layers stay frozen (None: train everything; with LoRA: adapters in "
                                     "the top k layers only)")
    lora_rank: int | None = Field(None, ge=1, description="train LoRA adapters of this rank (peft) instead of the "
                                  "weights; every push saves the merged full model")
    lora_alpha: float | None = Field(None, gt=0, description="LoRA scale numerator, the update is alpha / rank · BA "
                                     "(None: 2 × lora_rank)")
    lora_targets: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                    description="short names of the layers' linear modules that get adapters")
    keep_freed_memory: bool = Field(True, description="CPU, glibc: freed tensors stay in the process heap instead "
                                    "of being unmapped and page-faulted back in at every step (see stepline/trainer/memory.py)")

    # --- data ---
    groups_per_update: int = Field(8, ge=1, description="groups claimed from the pool per policy update")
    group_size: int | None = Field(None, ge=1, description="minimum sessions per group (None: any)")
    leaf_rule: Literal["all", "drop_superseded", "main"] = Field("drop_superseded",
                                                                 description="which leaves of a tree train")
    max_staleness: int = Field(4, description="train only on data at most this many versions behind the policy")
    dynamic_sampling: bool = Field(True, description="skip groups whose rewards do not vary (no signal)")
    full_batches: bool = Field(True, description="online: wait until groups_per_update trainable groups are claimed "
                                                 "(with dynamic sampling, keep drawing past skipped groups)")
    overlong_max_len: int | None = Field(None, ge=1, description="DAPO overlong shaping: max trajectory tokens")
    overlong_buffer: int = Field(0, ge=0, description="DAPO overlong shaping: soft-penalty buffer before max")
    overlong_factor: float = Field(1.0, ge=0, description="DAPO overlong shaping: penalty at max_len")
    sft_min_reward: float | None = Field(None, description="sft: train only episodes with outcome >= this")
    count_abandoned: bool = Field(True, description="abandoned sessions (ended by the gateway's idle reaper) with a "
                                  "terminal reward train with their group; False: left out (not in its baseline either)")

    # --- algorithm (names from stepline.trainer.algorithms registries) ---
    advantage: str = Field("grpo", description="advantage estimator, a key of ADVANTAGES")
    advantage_args: dict[str, Any] = Field(default_factory=dict, description="keyword hyper-parameters for it")
    ratio: str = Field("step", description="importance ratio level, a key of RATIOS: token | step | sequence")
    policy_loss: str = Field("ppo", description="a key of POLICY_LOSSES: ppo (clipped surrogate) | cispo | gmpo | "
                             "dppo | drpo | cppo (the last three bound each token's probability shift; ratio token)")
    policy_loss_args: dict[str, Any] = Field(default_factory=dict, description="the policy loss's own keyword "
                                             "hyper-parameters, e.g. {delta = 0.1} for dppo/drpo/cppo")
    clip_rule: str = Field("fixed", description="a key of CLIP_RULES, how the ratio's clip range is set per token: "
                           "fixed (clip_low/clip_high) | gapo (ε_high from the group's correct count) | ripo "
                           "(sqrt(δ/π_old)) | stale (staleness-shrunk endpoint; recompute only); ppo and cispo only")
    clip_rule_args: dict[str, Any] = Field(default_factory=dict, description="keyword hyper-parameters of the clip "
                                           "rule, e.g. {clip_max = 0.4} (gapo), {delta = 0.02} (ripo)")
    reference_template: str = Field("{reference}", description="igpo: how a session's gold answer "
                                    "(metadata.reference) is written after each state for its probability")
    sapo_coef: float = Field(0.0, ge=0, description="SAPO: weight γ of the conditional KL 1[r < τ, A > 0]·log r "
                             "(0: off)")
    sapo_tau: float = Field(1.0, gt=0, le=1, description="SAPO: ratio threshold τ below which positive tokens are "
                            "pulled back")
    loss_aggregation: str = Field("episode-mean", description="a name in AGGREGATIONS")
    loss_token_norm: float | None = Field(None, gt=0, description="the constant C of seq-mean-token-sum-norm "
                                          "(Dr. GRPO: the maximum generation length, in tokens)")
    clip_low: float = Field(0.2, ge=0, description="lower clip epsilon of the surrogate")
    clip_high: float = Field(0.28, ge=0, description="upper clip epsilon (clip-higher)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip constant c for negative advantages")
    old_logprobs: Literal["engine", "recompute"] = Field(
        "engine", description="ratio denominator: engine's recorded logprobs, or the trainer's own at update start "
        "(decoupled objective, with truncated IS against the engine)")
    tis_cap: float = Field(2.0, gt=0, description="truncation of the IS weight stepline/trainer/engine (recompute only)")
    tis_level: Literal["token", "step"] = Field("step", description="IS weight per token or per step")
    is_correction: Literal["tis", "icepop", "mis"] = Field(
        "tis", description="recompute only: bound the stepline/trainer/engine weight by truncation at tis_cap (tis), by "
        "masking tokens outside [is_floor, tis_cap] (icepop), or by rejecting trajectories whose product ratio "
        "exceeds tis_cap (mis)")
    is_floor: float = Field(0.5, ge=0, description="icepop: lower bound of the kept stepline/trainer/engine ratio")
    imitation_coef: float = Field(0.0, ge=0, description="self-imitation (SIL, RAFT): added to every step's "
                                  "advantage of an episode whose outcome reached imitation_min_outcome; groups that "
                                  "all reached it then train too, though dynamic sampling skips other flat groups "
                                  "(0: off)")
    imitation_min_outcome: float = Field(1.0, description="the outcome an episode needs for the imitation bonus")
    failure_coef: float = Field(0.0, ge=0, description="negative reinforcement (NSR): subtracted from every step's "
                                "advantage of an episode whose outcome stayed below imitation_min_outcome; groups "
                                "that all failed then train too instead of being skipped (0: off)")
    negative_scale: UnitInterval | dict[str, UnitInterval] = Field(
        1.0, description="multiplies every negative step advantage (after the bonuses), one number or one per "
        "harness (missing ones 1): 0 trains only the steps that did better than their baseline (positive-sample "
        "reinforcement), 1 the estimator as it is")
    expert_sft_coef: float = Field(0.0, ge=0, description="an expert's episodes in a training group "
                                   "(`expert_per_group`): 0 trains them as group members, by the policy gradient "
                                   "with their advantage; > 0 leaves them out of the group's baseline and trains "
                                   "their tokens by cross-entropy with this weight, an imitation anchor beside RL")
    kl_coef: float = Field(0.0, ge=0, description="weight of KL(policy || frozen reference); 0 loads no reference")
    kl_estimator: str = Field("k3", description="a key of KL_ESTIMATORS: k1 | k2 | k3")
    entropy_coef: float = Field(0.0, ge=-1, le=1, description="entropy bonus weight; negative: entropy "
                                "minimisation, which sharpens the sampled distribution towards its mode")

    # --- critic ---
    critic: bool = Field(False, description="train a value head on the policy's final hidden states")
    critic_warmup_updates: int = Field(0, ge=0, description="updates that train only the critic at the start")
    critic_lr: float = Field(1e-3, gt=0, description="learning rate of the value head")
    value_coef: float = Field(0.5, ge=0, description="weight of the value loss")
    value_clip: float | None = Field(0.2, gt=0, description="value clipping range (None: unclipped)")

    # --- optimisation ---
    epochs: int = Field(1, ge=1, description="passes over each update's data")
    minibatches: int = Field(1, ge=1, description="optimizer steps per epoch; must divide groups_per_update")
    micro_batch_episodes: int = Field(8, ge=1, description="sessions per forward pass (gradient accumulation)")
    micro_batch_tokens: int | None = Field(None, ge=1, description="at most this many tokens per forward pass (each "
                                           "session's own tree; one larger than it goes alone); None: no bound")
    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations in backward: "
                                         "memory for long contexts (a tree mask's attention is L x L per layer)")
    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="lr schedule after warm-up")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear lr warm-up")
    max_grad_norm: float = Field(1.0, gt=0, description="gradient clipping by global norm")
    max_updates: int | None = Field(None, ge=1, description="stop after this many updates (None: run until idle)")
    idle_timeout: float | None = Field(None, gt=0, description="stop when the pool has no ready group for this long")
    max_seconds: float | None = Field(None, gt=0, description="no update starts after this many seconds of the loop "
                                      "(a time budget; None: none)")
    poll_interval: float = Field(0.5, gt=0, description="seconds between claims when the pool has nothing ready")

    # --- weights, checkpoints, logs ---
    push_every: int = Field(1, ge=1, description="push weights to the gateway every k updates")
    gateway_url: str | None = Field(None, description="gateway base URL for /admin/update_weights (None: no push)")
    admin_token: str | None = Field(None, description="gateway admin token (or env STEPLINE_ADMIN_TOKEN)")
    keep_weights: int = Field(2, ge=1, description="pushed weight directories kept on disk")
    push_deltas: bool = Field(True, description="push only the tensors that changed since the engines' full "
                                                "weights (stepline/trainer/push.py); False: every push in full")
    checkpoint_every: int = Field(10, ge=1, description="checkpoint every k updates (and at the end)")
    tensorboard: bool = Field(True, description="also write metrics to TensorBoard under output_dir/tb")
    progress: bool = Field(True, description="show a live progress bar")

    @field_validator("max_staleness")
    @classmethod
    def _staleness(cls, v: int) -> int:
        if v < 0:
            raise ValueError("max_staleness must be >= 0 (0 = on-policy only)")
        return v

    @field_validator("model_dir")
    @classmethod
    def _model(cls, v: Path) -> Path:
        problem = model_dir_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("train_layers")
    @classmethod
    def _layers(cls, v: int | None, info: ValidationInfo) -> int | None:
        """At most the model's number of layers (read from its config.json, nothing loaded)."""
        model_dir = info.data.get("model_dir")  # absent where it failed its own check
        if v is not None and model_dir is not None and (model_dir / "config.json").is_file():
            n = json.loads((model_dir / "config.json").read_text()).get("num_hidden_layers")
            if n is not None and v > n:
                raise ValueError(f"train_layers ({v}) exceeds the model's {n} layers")
        return v

    @field_validator("lora_targets")
    @classmethod
    def _targets(cls, v: list[str], info: ValidationInfo) -> list[str]:
        """Names of linear modules inside the model's layers (checked on a weightless meta-device copy)."""
        if not v:
            raise ValueError("lora_targets is empty")
        model_dir = info.data.get("model_dir")
        if model_dir is not None and (model_dir / "config.json").is_file() and info.data.get("lora_rank") is not None:
            known = _linear_names(model_dir)
            unknown = sorted(set(v) - known)
            if unknown:
                raise ValueError(f"{unknown} are not linear layers of the model; expected some of {sorted(known)}")
        return v

    @field_validator("advantage", "ratio", "policy_loss", "loss_aggregation", "kl_estimator", "clip_rule")
    @classmethod
    def _registered(cls, v: str, info: ValidationInfo) -> str:
        """Each algorithm name must be a key of its registry in `stepline.trainer.algorithms`."""
        from stepline.trainer import algorithms

        registry = {"advantage": algorithms.ADVANTAGES, "ratio": algorithms.RATIOS,
                    "policy_loss": algorithms.POLICY_LOSSES, "clip_rule": algorithms.CLIP_RULES,
                    "loss_aggregation": algorithms.AGGREGATIONS, "kl_estimator": algorithms.KL_ESTIMATORS}
        return _known(v, registry[info.field_name])

    @model_validator(mode="after")
    def _consistent(self) -> TrainerConfig:
        from stepline.trainer.algorithms import ADVANTAGES

        if self.groups_per_update % self.minibatches:
            raise ValueError(f"groups_per_update ({self.groups_per_update}) must be divisible by "
                             f"minibatches ({self.minibatches})")
        _accepted("advantage_args", self.advantage_args, ADVANTAGES[self.advantage], f"advantage {self.advantage!r}")
        if (self.loss_aggregation == "seq-mean-token-sum-norm") != (self.loss_token_norm is not None):
            raise ValueError("loss_token_norm is the constant C of loss_aggregation 'seq-mean-token-sum-norm': "
                             "set both or neither")
        self._objective_options()
        if self.advantage in ("gae", "capo") and not self.critic:
            raise ValueError(f"advantage {self.advantage!r} needs a critic: set critic = true")
        if "reference_template" in self.model_fields_set and self.advantage != "igpo":
            raise ValueError("reference_template is for advantage 'igpo' (the gold answer's probability)")
        if "{reference}" not in self.reference_template:
            raise ValueError("reference_template must contain {reference}")
        if self.push_every > self.max_staleness + 1:
            raise ValueError(f"push_every ({self.push_every}) must be <= max_staleness + 1 ({self.max_staleness + 1}): "
                             "otherwise every call the engine serves is already too stale to train on")
        if self.schedule != "constant" and self.max_updates is None:
            raise ValueError(f"schedule {self.schedule!r} decays over max_updates: set max_updates")
        if self.overlong_max_len is not None and self.overlong_buffer >= self.overlong_max_len:
            raise ValueError("overlong_buffer must be smaller than overlong_max_len")
        if self.autocast_bf16 and self.dtype != "float32":
            raise ValueError("autocast_bf16 keeps fp32 master weights: it needs dtype = \"float32\"")
        unused = sorted({"lora_alpha", "lora_targets"} & self.model_fields_set) if self.lora_rank is None else []
        if unused:
            raise ValueError(f"{', '.join(unused)} set but lora_rank is not (no LoRA adapters)")
        return self

    def _objective_options(self) -> None:
        """Options of the objective that only mean something together with another one."""
        from stepline.trainer.algorithms import CLIP_RULES, COMMON_LOSS_ARGS, POLICY_LOSSES

        _accepted("policy_loss_args", self.policy_loss_args, POLICY_LOSSES[self.policy_loss],
                  f"policy_loss {self.policy_loss!r}", exclude=COMMON_LOSS_ARGS)
        _accepted("clip_rule_args", self.clip_rule_args, CLIP_RULES[self.clip_rule], f"clip_rule {self.clip_rule!r}")
        if self.policy_loss in ("dppo", "drpo", "cppo") and self.ratio != "token":
            raise ValueError(f"policy_loss {self.policy_loss!r} bounds each token's probability shift: "
                             f"set ratio = \"token\" (not {self.ratio!r})")
        if self.clip_rule != "fixed" and self.policy_loss not in ("ppo", "cispo"):
            raise ValueError(f"clip_rule {self.clip_rule!r} sets the ratio clip of ppo or cispo, "
                             f"not of policy_loss {self.policy_loss!r}")
        if self.clip_rule == "stale" and self.old_logprobs != "recompute":
            raise ValueError("clip_rule 'stale' compares the trainer's logprobs with the engine's: "
                             "set old_logprobs = \"recompute\"")
        for field, args in (("policy_loss_args", self.policy_loss_args), ("clip_rule_args", self.clip_rule_args)):
            for name, value in args.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ValueError(f"{field}.{name} must be a number, got {value!r}")
                if name in ("delta", "prefix_delta", "clip_max") and value <= 0:
                    raise ValueError(f"{field}.{name} must be > 0, got {value}")
                if name == "min_weight" and not 0 < value <= 1:
                    raise ValueError(f"{field}.min_weight must be in (0, 1], got {value}")
        if self.clip_rule_args.get("clip_max", math.inf) < self.clip_low:
            raise ValueError(f"clip_rule_args.clip_max ({self.clip_rule_args['clip_max']}) must be >= clip_low "
                             f"({self.clip_low})")
        if self.dual_clip is not None and self.policy_loss != "ppo":
            raise ValueError(f"dual_clip applies to policy_loss 'ppo' only, not {self.policy_loss!r}")
        if "sapo_tau" in self.model_fields_set and self.sapo_coef == 0:
            raise ValueError("sapo_tau set but sapo_coef is 0 (SAPO's term is off)")
        if self.is_correction != "tis" and self.old_logprobs != "recompute":
            raise ValueError(f"is_correction {self.is_correction!r} bounds the stepline/trainer/engine weight, which exists "
                             "only with old_logprobs = \"recompute\"")
        if "is_floor" in self.model_fields_set and self.is_correction != "icepop":
            raise ValueError("is_floor is IcePop's lower bound: set is_correction = \"icepop\"")
        if self.is_correction == "icepop" and self.is_floor >= self.tis_cap:
            raise ValueError(f"is_floor ({self.is_floor}) must be below tis_cap ({self.tis_cap})")

    @property
    def lora_scale_alpha(self) -> float | None:
        """lora_alpha, or its default 2 × lora_rank (None without LoRA)."""
        if self.lora_rank is None:
            return None
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank


def _linear_names(model_dir: Path) -> set[str]:
    """The lora_targets a model accepts, from its architecture on the meta device (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stepline.trainer.trainable import linear_names

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return linear_names(model)


def _accepted(field: str, args: dict[str, Any], fn: Any, what: str, exclude: frozenset[str] = frozenset()) -> None:
    """Refuse keyword hyper-parameters that `fn` does not take (naming the field)."""
    params = inspect.signature(fn).parameters
    known = {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY} - exclude
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(f"{field}: {unknown} not accepted by {what}; it takes {sorted(known)}")


def _known(name: str, registry: Any) -> str:
    if name not in registry:
        raise ValueError(f"unknown name {name!r}; expected one of {sorted(registry)}")
    return name
