"""The built-in CPU engine: HF transformers behind SGLang's native /generate API subset.

    stepline engine --model DIR --port N          (stepline.engine.cli)
    running_engine(model_dir) -> url              (stepline.engine.testing, for tests)

Modules: protocol (request models and checks), sampling (pure next-token sampling), kv (the batch's
KV store, a row per running sequence), prefix_cache (finished sequences' K/V, reused by prompts that
extend them), scheduler (the continuous-batching thread), server (FastAPI routes).
Errors: protocol.BadRequest (-> HTTP 400); everything else inside a step fails that step's
sequences with finish_reason abort and the engine keeps serving.
"""
