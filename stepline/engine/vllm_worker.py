"""Stepline's vLLM worker extension: load a checkpoint folder (full, or a delta) into the running model in place.

    vllm serve DIR --worker-extension-cls stepline.engine.vllm_worker.SteplineWorker   (stepline.launch.vllm_server)
    POST /collective_rpc {"method": "stepline_load", "kwargs": {"path": DIR}}        (dev mode; the gateway's adapter)
      -> [{"ok": true, "loaded": N, "checksum": "..."} per worker]   or   [{"ok": false, "message": "..."}]

vLLM mixes this class into its worker (the RL systems that drive vLLM, verl and OpenRLHF among them, update
weights the same way), so it runs inside the vLLM process: it imports vLLM's torch, never vLLM at module
level, and of Stepline only `stepline.weightdelta` (the launcher puts these two files on vLLM's path alone).

Why not vLLM 0.32's own `reload_weights(weights_path=...)`: it reloads layer by layer, and a tied LM head
(Qwen3 0.6B-4B, Llama 3.2, Gemma, SmolLM2) receives no tensor of its own, so it keeps the kernel it was
prepared with at start (on CPU a packed copy of the old embedding): the model would serve two policies
at once. Here the folder's tensors go through the same in-place layerwise load (`model_runner.reload_weights`
with an iterator: each loaded layer's kernel is rebuilt, the rest keep theirs, parameter storage never moves),
and the tied head's kernel is then rebuilt from the embedding it shares.

A delta (stepline.weightdelta) is checked first: its tensors are digested here and folded into this worker's
digest table of what it serves; unless that gives the delta's checksum nothing is loaded (`ok` false: the
gateway answers 400 and the trainer pushes the full weights).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from stepline.weightdelta import DELTA_FILE, checksum, digest, folder_digests, read_manifest

__all__ = ["SteplineWorker"]


class SteplineWorker:
    """Mixed into vLLM's worker class: `self.model_runner` and `self.model_config` are the worker's."""

    _stepline_digests: dict[str, bytes] | None = None  # digest table of the tensors served (None: not computed)
    _stepline_source: str | None = None  # the full folder last loaded (None: the folder vLLM started on)

    def stepline_load(self, path: str) -> dict[str, Any]:
        try:
            delta = read_manifest(path)
            files = [Path(path) / DELTA_FILE] if delta is not None else sorted(Path(path).glob("*.safetensors"))
            if not files:
                return {"ok": False, "message": f"{path} holds no *.safetensors file"}
            tensors = _read(files)
            table = None
            if delta is not None:
                table = self._stepline_table()
                table.update({name: digest(name, t) for name, t in tensors.items()})
                if checksum(table) != delta.checksum:
                    return {"ok": False, "message": f"delta {path} would not give the trainer's state: this engine "
                                                    f"lacks its base {delta.anchor} (version {delta.anchor_version})"}
        except (OSError, ValueError) as exc:
            return {"ok": False, "message": f"{path} is unreadable: {exc}"}
        self._stepline_install(tensors)
        self._stepline_digests = table
        if delta is None:
            self._stepline_source = path
        return {"ok": True, "loaded": len(tensors), "checksum": checksum(table) if table is not None else None}

    def stepline_checksum(self) -> str:
        """The checksum of the weights served (stepline.weightdelta), for tests and checks."""
        return checksum(self._stepline_table())

    def _stepline_table(self) -> dict[str, bytes]:
        if self._stepline_digests is None:
            self._stepline_digests = folder_digests(self._stepline_source or self.model_config.model)  # type: ignore[attr-defined]
        return dict(self._stepline_digests)

    def _stepline_install(self, tensors: dict[str, Any]) -> None:
        import torch

        runner = self.model_runner  # type: ignore[attr-defined]
        quiet = logging.getLogger("vllm.model_executor.model_loader.reload")
        level = quiet.level
        quiet.setLevel(logging.ERROR)  # each layer a delta leaves out is "Failed to load weights": it keeps its own
        try:
            with torch.no_grad():
                runner.reload_weights(weights_iterator=iter(tensors.items()))
        finally:
            quiet.setLevel(level)
        model = runner.get_model()
        head, embed = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "embed_tokens", None)
        quant = getattr(head, "quant_method", None)
        if quant is not None and embed is not None and getattr(head, "weight", None) is embed.weight:
            quant.process_weights_after_loading(head)  # the tied head's kernel, from the new embedding


def _read(files: list[Path]) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors
