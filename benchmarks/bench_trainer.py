"""Trainer benchmark: tree forward vs the naive per-step forward on multi-turn sessions; and, with --model,
the training speed of full fine-tuning against the faster options on a real model.

    .venv/bin/python benchmarks/bench_trainer.py                   # 8 sessions × 10 turns, CPU or the GPU if any
    .venv/bin/python benchmarks/bench_trainer.py --turns 20 --hidden 512 --layers 8
    .venv/bin/python benchmarks/bench_trainer.py --model models/smollm2 # full fp32 vs bf16 / top-6 / LoRA, 20 SFT steps
    .venv/bin/python benchmarks/bench_trainer.py --linear --bf16 --checkpointing  # one 6k-token chain: mask vs causal

--model DIR: a short SFT (--steps optimizer steps on the same rows: --sessions sessions of --turns turns of
this repository's README and docs/ text, tokenized by the model's tokenizer) through the trainer's own
`build_policy` and `update`, once per variant (TrainerConfig fields): full fp32, bf16 autocast, the top
--top-layers layers, both, LoRA rank --lora-rank, LoRA + bf16. The variants live in one process and
take their steps in turn (step 1 of each, then step 2 of each, the order rotating), so a change in the
machine's load hits all of them alike. Printed per variant: trainable parameters, training tokens/s
(tokens through the model per second of update, median over steps 2..N; step 1 allocates the optimizer
state), its ratio to full fp32, and the SFT loss at the first, the middle and the last step (each
variant has its own learning rate, --lr / --top-lr / --lora-lr, chosen so that the losses fall alike);
then what one weight push costs: save_weights (LoRA merged) and the engine's reload of the folder
(from_pretrained, as stepline/engine/server.py does on update_weights_from_disk).

Tree mode: each session is a chain of turns (prompt, then per turn: sampled action + harness observation), stored
through the pool's own radix tree and steps view. A *training step* is forward + backward of the action
tokens' logprobs for all sessions:

- tree:  each session's tree once, tree attention mask, one padded row per tree (stepline.trainer.tree_forward; these
         sessions share no prefix, so a row each: benchmarks/bench_group_packing.py measures groups that do);
- naive: every step's full sequence (state + action) as its own row, right-padded, `rows` per forward
         (sorted by length, so padding is small) — how a trainer that treats each turn as one completion
         sees the data.

Both produce the same logprobs (checked, max |diff| printed).

--linear: one linear episode (a session whose calls extend each other, ~6k tokens: prompt 500, 16 turns of action 100
and observation 270, like a BFCL multi-turn demonstration) on a model of SmolLM2-135M's shape (random weights, or
--model's), one forward + backward of its action tokens' logprobs with the dense tree mask (`tree_mask=True`) and
with the causal path a linear row takes (no 4-D mask: SDPA's causal kernel), alternating, best of --repeats;
--bf16 (autocast, as autocast_bf16 does) and --checkpointing (gradient_checkpointing) as the BFCL job trains. Times: both variants in one process,
alternating, best of --repeats (robust on a shared machine). Peak memory: one step in a fresh subprocess
per variant, above what the model and data hold (CUDA: max allocated; CPU: growth of the peak RSS).
Printed side by side with ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import stepline.trainer  # noqa: F401  (before torch: it sets OpenMP's wait policy, stepline/trainer/__init__.py)
from stepline.datapool.records import Reward, SessionInfo
from stepline.datapool.steps import build_episode
from stepline.datapool.tree import RadixTree
from stepline.trainer.tree_forward import forest_forward, pack_forest


def make_sessions(n: int, turns: int, prompt: int, action: int, obs: int, vocab: int, seed: int,
                  text: np.ndarray | None = None):
    """n chains of turns; random token ids, or consecutive slices of `text` (token ids) when given."""
    g = np.random.default_rng(seed)
    cursor = 0

    def take(k: int) -> np.ndarray:
        nonlocal cursor
        if text is None:
            return g.integers(10, vocab, k).astype(np.int32)
        if cursor + k > len(text):
            raise ValueError(f"the text has {len(text)} tokens: too few for {n} sessions")
        cursor += k
        return text[cursor - k : cursor].astype(np.int32)

    episodes = []
    for s in range(n):
        tree, seq = RadixTree(f"s{s}"), take(prompt)
        for t in range(turns):
            out = take(action)
            tree.insert(t, seq, out, np.full(action, -7.0, np.float32), 0)
            seq = np.concatenate([seq, out, take(obs)])
        info = SessionInfo(f"s{s}", task_id="t", harness="h", status="completed")
        episodes.append(build_episode(info, [Reward(f"s{s}", 1.0)], tree.snapshot()))
    return episodes


def naive_rows(model, episodes, forest, rows: int) -> torch.Tensor:
    """Every step's full sequence as its own right-padded row, `rows` per forward; logprobs in forest order."""
    device = next(model.parameters()).device
    steps = [(e, traj, st) for e, ep in enumerate(episodes) for traj in ep.trajectories[:1] for st in traj.steps]
    steps.sort(key=lambda x: x[2].action_end)  # rows of similar length together: the least padding
    out = torch.zeros(len(forest.targets), device=device)
    for i in range(0, len(steps), rows):
        chunk = steps[i : i + rows]
        width = max(st.action_end for _, _, st in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.int64)
        mask = torch.zeros(len(chunk), width, dtype=torch.int64)
        for r, (_, traj, st) in enumerate(chunk):
            ids[r, : st.action_end] = torch.from_numpy(traj.tokens[: st.action_end].astype(np.int64))
            mask[r, : st.action_end] = 1
        hidden = model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        hidden = hidden.last_hidden_state
        for r, (e, _traj, st) in enumerate(chunk):
            src = hidden[r, st.action_start - 1 : st.action_end - 1]
            logits = model.get_output_embeddings()(src).float() / st.temperature
            lp = torch.log_softmax(logits, -1).gather(-1, ids[r, st.action_start : st.action_end, None].to(device))
            where = ((forest.episode == e) & (forest.call_index == st.call_index)).nonzero().squeeze(-1)
            out = out.index_put((where.to(device),), lp.squeeze(-1))
    return out


def _setup(args, model_dir: Path):
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    episodes = make_sessions(args.sessions, args.turns, args.prompt, args.action, args.obs, 3000, args.seed)
    forest = pack_forest(episodes)

    def step(variant: str) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        lp = forest_forward(model, forest, with_entropy=False).logprobs if variant == "tree" \
            else naive_rows(model, episodes, forest, args.rows)
        lp.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return lp.detach()

    return device, forest, step


def measure_time(args, model_dir: Path) -> dict:
    """Both variants in one process, alternating, best of `repeats` each (the machine may be shared)."""
    device, forest, step = _setup(args, model_dir)
    out = {v: {"logprobs": step(v).cpu().tolist(), "times": []} for v in ("tree", "naive")}  # warm-up
    for _ in range(args.repeats):
        for v in ("tree", "naive"):
            start = time.perf_counter()
            step(v)
            out[v]["times"].append(time.perf_counter() - start)
    for v, forward_tokens in (("tree", forest.num_tokens), ("naive", forest.naive_tokens)):
        out[v].update(seconds=min(out[v].pop("times")), action_tokens=len(forest.targets),
                      forward_tokens=forward_tokens)
    return out


def measure_memory(variant: str, args, model_dir: Path) -> dict:
    """Peak memory of one training step above what the model and data already hold (fresh process)."""
    device, _, step = _setup(args, model_dir)
    if device.type == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    step(variant)
    peak = (torch.cuda.max_memory_allocated() - base if device.type == "cuda"
            else (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024)
    return {"peak_bytes": int(peak)}


# SmolLM2-135M's shape (its config.json): 30 layers, hidden 576, 9 heads of 64, 3 KV heads, vocabulary 49,152
SMOLLM2_135M_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)


def _linear_model(args) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if args.model is not None:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    else:
        config = LlamaConfig(**SMOLLM2_135M_SHAPE)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    model = model.to(args.device).train()
    if args.checkpointing:  # as build_policy does
        model.activation_checkpointing_enable({"use_reentrant": False})
    return model


def measure_linear(args) -> dict:
    """One linear episode, forward + backward: the dense tree mask vs the causal path, alternating, best of repeats."""
    model = _linear_model(args)
    episodes = make_sessions(1, args.turns, args.prompt, args.action, args.obs, model.config.vocab_size, args.seed)
    forest = pack_forest(episodes)
    assert forest.linear_rows, "a chain of calls packs as one linear row"
    out: dict = {"tokens": forest.num_tokens, "action_tokens": len(forest.targets), "vocab": model.config.vocab_size}
    for _ in range(args.repeats):
        for name, tree_mask in (("tree mask", True), ("causal", False)):
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.bf16):
                logprobs = forest_forward(model, forest, with_entropy=False, tree_mask=tree_mask).logprobs
            logprobs.sum().backward()
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            v = out.setdefault(name, {"seconds": []})
            v["seconds"].append(seconds)
            v["logprobs"] = logprobs.detach().float()
            print(f"{name}: {seconds:.1f} s", file=sys.stderr, flush=True)
    return out


def report_linear(args, r: dict) -> None:
    dense, causal = r["tree mask"], r["causal"]
    diff = float((dense["logprobs"] - causal["logprobs"]).abs().max())
    source = args.model or "random weights"
    print(f"one linear episode of {r['tokens']:,} tokens ({r['action_tokens']:,} action tokens; prompt {args.prompt}, "
          f"{args.turns} turns of action {args.action} + observation {args.obs}); SmolLM2-135M shape ({source}); "
          f"{args.device}, {args.threads} threads, bf16 autocast {args.bf16}, gradient checkpointing "
          f"{args.checkpointing}; forward + backward, best of {args.repeats}")
    rates = {}
    for name, v in (("tree mask", dense), ("causal", causal)):
        best = min(v["seconds"])
        rates[name] = r["tokens"] / best
        print(f"{name:10s} {best:8.1f} s  {rates[name]:8.1f} tokens/s  (all: "
              + ", ".join(f"{s:.1f}" for s in v["seconds"]) + ")")
    print(f"causal / tree mask: {rates['causal'] / rates['tree mask']:.2f}× tokens/s; "
          f"max |logprob difference| {diff:.2e}")


def sft_variants(args) -> dict[str, dict]:
    """Variant name -> the TrainerConfig fields that make it (the learning rate included)."""
    k, r = args.top_layers, args.lora_rank
    full, top, lora = {"lr": args.lr}, {"lr": args.top_lr, "train_layers": k}, {"lr": args.lora_lr, "lora_rank": r}
    return {
        "full fp32": full,
        "bf16 autocast": {**full, "autocast_bf16": True},
        f"top-{k} layers": top,
        f"bf16 + top-{k}": {**top, "autocast_bf16": True},
        f"LoRA r={r}": lora,
        f"LoRA r={r} bf16": {**lora, "autocast_bf16": True},
    }


def readme_tokens(model_dir: Path) -> np.ndarray:
    """This repository's README and docs/ as token ids of the model's tokenizer: natural text the model can learn."""
    from transformers import AutoTokenizer

    root = Path(__file__).resolve().parents[1]  # the README and docs/: the same prose however it is split
    text = "\n".join(path.read_text() for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))])
    return np.asarray(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"], dtype=np.int64)


def measure_sft(args) -> dict:
    """Every variant's short SFT on the same rows, the variants taking their optimizer steps in turn."""
    from stepline.datapool.records import Group
    from stepline.trainer.batch import build_batch
    from stepline.trainer.config import TrainerConfig
    from stepline.trainer.loop import build_policy, objective
    from stepline.trainer.update import update

    episodes = make_sessions(args.sessions, args.turns, args.prompt, args.action, args.obs, 0, args.seed,
                             text=readme_tokens(args.model))
    batch = build_batch([Group("g", "t::h", episodes, 0)])
    policies, objectives, out = {}, {}, {}
    for name, fields in sft_variants(args).items():
        cfg = TrainerConfig(model_dir=args.model, output_dir=Path(tempfile.gettempdir()) / "bench_trainer", mode="sft",
                            device=args.device, progress=False, tensorboard=False, groups_per_update=1,
                            micro_batch_episodes=args.sessions, **fields)
        torch.manual_seed(args.seed)
        policies[name], objectives[name] = build_policy(cfg), objective(cfg, 0, True)
        trainable = sum(p.numel() for p in policies[name].parameters())
        out[name] = {"fields": fields, "trainable": trainable, "seconds": [], "loss": []}
    names = list(policies)
    for step in range(args.steps):
        for name in names[step % len(names):] + names[: step % len(names)]:
            m = update(policies[name], batch, objectives[name], version=0)
            out[name]["seconds"].append(m["update_seconds"])
            out[name]["loss"].append(m["policy_loss"])
            out[name]["forward_tokens"] = m["forward_tokens_per_s"] * m["update_seconds"]
        print(f"step {step + 1}/{args.steps}: " + "  ".join(f"{n} {out[n]['seconds'][-1]:.1f}s" for n in names),
              file=sys.stderr, flush=True)
    out["push"] = measure_push(policies[names[0]].model, policies[names[-1]].model, args.model)
    return out


def measure_push(full: torch.nn.Module, lora: torch.nn.Module, model_dir: Path) -> dict:
    """Seconds to save the full model and a LoRA model (merged), and to reload each as the engine does."""
    from transformers import AutoModelForCausalLM

    from stepline.trainer.weight_sync import save_weights

    times = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in (("full", full), ("lora merged", lora)):
            start = time.perf_counter()
            path = save_weights(model, Path(tmp) / name.replace(" ", "-"), 1, model_dir)
            saved = time.perf_counter() - start
            start = time.perf_counter()
            AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            times[name] = {"save": saved, "load": time.perf_counter() - start,
                           "bytes": sum(f.stat().st_size for f in path.glob("*.safetensors"))}
    return times


def report_sft(args, r: dict) -> None:
    push = r.pop("push")
    first = next(iter(r.values()))
    print(f"SFT on {args.model}: {args.sessions} sessions × {args.turns} turns of README and docs/ text (prompt {args.prompt}, "
          f"action {args.action}, observation {args.obs} tokens; {first['forward_tokens']:,.0f} tokens through the "
          f"model per step), {args.steps} AdamW steps on the same rows; {args.device}, {args.threads} threads, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print("method: all variants in one process, taking their steps in turn (order rotating); tokens/s = median "
          "over steps 2..N")
    base = None
    mid = args.steps // 2
    print(f"{'variant':18s} {'lr':>8s} {'trainable':>12s} {'tokens/s':>9s} {'vs full':>8s} {'loss step 1':>12s} "
          f"{f'step {mid + 1}':>8s} {f'step {args.steps}':>8s}")
    for name, v in r.items():
        rate = v["forward_tokens"] / float(np.median(v["seconds"][1:] or v["seconds"]))
        base = base or rate
        print(f"{name:18s} {v['fields']['lr']:8.2g} {v['trainable']:12,d} {rate:9.1f} {rate / base:7.2f}× "
              f"{v['loss'][0]:12.3f} {v['loss'][mid]:8.3f} {v['loss'][-1]:8.3f}")
    for name, t in push.items():
        print(f"push, {name}: save_weights {t['save']:.2f} s, reload as the engine does {t['load']:.2f} s "
              f"({t['bytes'] / 2**20:,.0f} MiB)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, help="sessions (default 8; --model: 2)")
    p.add_argument("--turns", type=int, help="turns per session (default 10; --model: 4)")
    p.add_argument("--prompt", type=int, help="first prompt tokens (default 64; --model: 300)")
    p.add_argument("--action", type=int, help="sampled tokens per turn (default 24; --model: 40)")
    p.add_argument("--obs", type=int, help="observation tokens the harness adds per turn (default 24; --model: 35)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--rows", type=int, default=8, help="naive: step sequences per forward")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, help="a HF model directory: compare the SFT speed of the trainer's options")
    p.add_argument("--steps", type=int, default=20, help="--model: optimizer steps per variant")
    p.add_argument("--top-layers", type=int, default=6, help="--model: train_layers of the top-k variants")
    p.add_argument("--lora-rank", type=int, default=16, help="--model: lora_rank of the LoRA variants")
    p.add_argument("--lr", type=float, default=1e-5, help="--model: learning rate of full fine-tuning")
    p.add_argument("--top-lr", type=float, default=7e-5, help="--model: learning rate of the top-k variants")
    p.add_argument("--lora-lr", type=float, default=2e-4, help="--model: learning rate of the LoRA variants")
    p.add_argument("--linear", action="store_true", help="one linear ~6k-token episode: tree mask vs causal path")
    p.add_argument("--bf16", action="store_true", help="--linear: bf16 autocast")
    p.add_argument("--checkpointing", action="store_true", help="--linear: gradient checkpointing")
    p.add_argument("--only", choices=["time", "tree", "naive"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    # --model: sessions of ~565 tokens in 4 turns, like the main job's; the tree benchmark: many short turns
    # --linear: one ~6k-token chain of 16 turns, like a BFCL multi-turn demonstration
    shape = (1, 16, 500, 100, 270) if args.linear else (2, 4, 300, 40, 35) if args.model is not None \
        else (8, 10, 64, 24, 24)
    for name, default in zip(("sessions", "turns", "prompt", "action", "obs"), shape):
        if getattr(args, name) is None:
            setattr(args, name, default)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.linear:
        report_linear(args, measure_linear(args))
        return
    if args.model is not None:
        report_sft(args, measure_sft(args))
        return
    if args.only:
        result = measure_time(args, args.model_dir) if args.only == "time" else \
            measure_memory(args.only, args, args.model_dir)
        print(json.dumps(result))
        return
    from stepline.models import ModelShape, build_model

    with tempfile.TemporaryDirectory() as tmp:
        shape = ModelShape(hidden_size=args.hidden, num_layers=args.layers, num_heads=max(args.hidden // 64, 2),
                           num_kv_heads=max(args.hidden // 128, 1))
        model_dir = build_model(Path(tmp) / "m", kind="tiny", shape=shape)
        results = _subprocess("time", model_dir)
        for v in ("tree", "naive"):
            results[v].update(_subprocess(v, model_dir))
    _report(args, results)


def _subprocess(variant: str, model_dir: Path) -> dict:
    cmd = [sys.executable, __file__, *sys.argv[1:], "--only", variant, "--model-dir", str(model_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _report(args, r: dict) -> None:
    tree, naive = r["tree"], r["naive"]
    diff = float(np.max(np.abs(np.array(tree["logprobs"]) - np.array(naive["logprobs"]))))
    print(f"{args.sessions} sessions × {args.turns} turns (prompt {args.prompt}, action {args.action}, "
          f"observation {args.obs} tokens); model hidden {args.hidden}, {args.layers} layers; {args.device}, "
          f"{args.threads} threads; forward + backward, best of {args.repeats}")
    rows = [  # (name, tree, naive, format, tree's gain = naive/tree, or tree/naive for a rate)
        ("tokens through the model", tree["forward_tokens"], naive["forward_tokens"], "{:,.0f}", False),
        ("training step (s)", tree["seconds"], naive["seconds"], "{:.3f}", False),
        ("training tokens/s (action)", tree["action_tokens"] / tree["seconds"],
         naive["action_tokens"] / naive["seconds"], "{:,.0f}", True),
        ("peak memory (MiB)", tree["peak_bytes"] / 2**20, naive["peak_bytes"] / 2**20, "{:,.1f}", False),
    ]
    print(f"{'':28s} {'tree':>10s} {'naive':>10s} {'tree gain':>10s}")
    for name, a, b, fmt, rate in rows:
        gain = (a / b if rate else b / a) if a and b else float("nan")
        print(f"{name:28s} {fmt.format(a):>10s} {fmt.format(b):>10s} {gain:>9.2f}×")
    print(f"same results: max |logprob tree - naive| = {diff:.2e} over {tree['action_tokens']} action tokens")


if __name__ == "__main__":
    main()
