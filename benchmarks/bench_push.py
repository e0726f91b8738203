"""Weight push benchmark: a full push against a delta push (stepline/trainer/push.py), through the real path.

    .venv/bin/python benchmarks/bench_push.py                    # SmolLM2-135M (the cached build), top 10 of 30 layers
    .venv/bin/python benchmarks/bench_push.py --tiny --rounds 2  # a tiny random model: a smoke test in seconds

The trainer's side (WeightPusher and GatewayWeightSync) pushes to a real gateway in front of the built-in engine
(both in this process, on loopback), as in a job: one gateway and engine take the full pushes, another the deltas,
so each engine sees what it would in a job (an engine takes the digests of a full folder once, at the first delta
after it). The policy trains only its top --top-layers layers
(`train_layers`); before each push a stand-in optimizer step moves every trainable tensor. Each round makes one
full push (every tensor, save_pretrained, the engine loads the folder anew) and one delta push (the tensors
changed since the model folder the engine started on, loaded in place after the checksum check), the order
alternating between rounds so a change in the machine's load hits both alike. Printed per kind: bytes written,
seconds to write them (trainer), seconds for the gateway and engine to load them (pause, load, resume), and the
total, as medians over the rounds, with the ratio full / delta. After the last round the engine's greedy answer
is checked against a fresh engine on the full checkpoint (it must be the same).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM

from stepline.datapool import open_pool
from stepline.engine.testing import running_engine
from stepline.gateway.cli import running_gateway
from stepline.gateway.config import GatewaySettings
from stepline.models import ModelShape, build_model
from stepline.trainer.push import WeightPusher
from stepline.trainer.trainable import freeze_below_top
from stepline.trainer.weight_sync import GatewayWeightSync, save_weights

GREEDY = {"input_ids": [11, 12, 13, 14], "return_logprob": True,
          "sampling_params": {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}}


@dataclass
class TimedSync:
    """GatewayWeightSync, timing each push (the gateway's pause → load → resume)."""

    sync: GatewayWeightSync
    deltas: bool = True
    seconds: list[float] = field(default_factory=list)

    def push(self, path: Path, version: int) -> None:
        start = time.perf_counter()
        self.sync.push(path, version)
        self.seconds.append(time.perf_counter() - start)

    def close(self) -> None:
        self.sync.close()


@torch.no_grad()
def step(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)


def model_dir(args, tmp: Path) -> Path:
    if args.tiny:
        return build_model(tmp / "tiny", seed=0, shape=ModelShape(hidden_size=128, num_heads=2, num_kv_heads=1,
                                                                  num_layers=6))
    from stepline.pretrained import cached_build

    return cached_build()


def run(args, tmp: Path) -> dict[str, dict[str, list[float]]]:
    source = model_dir(args, tmp)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    freeze_below_top(model, args.top_layers)
    pushers = {"full": WeightPusher(tmp / "full", source, keep=1, deltas=False),
               "delta": WeightPusher(tmp / "delta", source, keep=1, deltas=True)}
    for pusher in pushers.values():
        pusher.anchor_on(model, source)
    out: dict[str, dict[str, list[float]]] = {k: {"bytes": [], "write": [], "load": [], "total": []} for k in pushers}
    pool = open_pool(f"sqlite:///{tmp / 'pool.db'}")

    async def main() -> None:
        settings = GatewaySettings(port=0, admin_token="tok")
        with running_engine(source) as full_url, running_engine(source) as delta_url:
            async with (running_gateway(settings, [full_url], source, pool) as full_gw,
                        running_gateway(settings, [delta_url], source, pool) as delta_gw):
                syncs = {"full": TimedSync(GatewayWeightSync(full_gw.url, "tok")),
                         "delta": TimedSync(GatewayWeightSync(delta_gw.url, "tok"))}
                for r in range(args.rounds):
                    step(model, r + 1)
                    order = ["full", "delta"] if r % 2 == 0 else ["delta", "full"]
                    for kind in order:
                        stats = await asyncio.to_thread(pushers[kind].push, model, r + 1, syncs[kind])
                        assert stats.kind == kind, stats
                        load = syncs[kind].seconds[-1]
                        for key, value in (("bytes", stats.bytes), ("write", stats.seconds - load), ("load", load),
                                           ("total", stats.seconds)):
                            out[kind][key].append(value)
                    print(f"round {r + 1}/{args.rounds}: " + "  ".join(f"{k} {out[k]['total'][-1]:.2f}s" for k in order),
                          flush=True)
                served = (await asyncio.to_thread(httpx.post, f"{delta_url}/generate", json=GREEDY, timeout=600)).json()
                for sync in syncs.values():
                    sync.close()
        with running_engine(save_weights(model, tmp / "fresh", args.rounds, source)) as url:
            fresh = httpx.post(f"{url}/generate", json=GREEDY, timeout=600).json()
        assert served["output_ids"] == fresh["output_ids"], (served, fresh)

    try:
        asyncio.run(main())
    finally:
        pool.close()
    return out


def report(args, out: dict[str, dict[str, list[float]]]) -> None:
    name = "tiny (6 layers)" if args.tiny else "SmolLM2-135M (cached build)"
    print(f"\n{name}, top {args.top_layers} layers trained, float32; {args.rounds} rounds, medians; "
          f"built-in engine behind the gateway on loopback, {torch.get_num_threads()} threads")
    print(f"{'push':6s} {'MiB':>9s} {'write s':>8s} {'load s':>8s} {'total s':>8s}")
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in out.items()}
    for kind, m in med.items():
        print(f"{kind:6s} {m['bytes'] / 2**20:9.1f} {m['write']:8.3f} {m['load']:8.3f} {m['total']:8.3f}")
    full, delta = med["full"], med["delta"]
    print(f"{'full/delta':10s} bytes {full['bytes'] / delta['bytes']:.2f}×, write {full['write'] / delta['write']:.2f}×, "
          f"load {full['load'] / delta['load']:.2f}×, total {full['total'] / delta['total']:.2f}×")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a tiny random model (6 layers) instead of SmolLM2")
    p.add_argument("--top-layers", type=int, help="layers trained (default 10; --tiny: 2)")
    p.add_argument("--rounds", type=int, default=5, help="full + delta pushes each")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    args = p.parse_args()
    args.top_layers = args.top_layers or (2 if args.tiny else 10)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        report(args, run(args, Path(tmp)))


if __name__ == "__main__":
    main()
