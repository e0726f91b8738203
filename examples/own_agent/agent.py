"""A stand-in for *your* agent: any program that talks to an OpenAI-compatible endpoint.

Stepline gives it the endpoint in the usual variables (OPENAI_BASE_URL, OPENAI_API_KEY) and the task in
STEPLINE_TASK_ID; it knows nothing else of Stepline. This one answers "add-A-B" tasks in one call and
writes its answer to $STEPLINE_OUT_DIR/answer.txt for the verifier.
"""

import os
from pathlib import Path

from openai import OpenAI

a, b = (int(x) for x in os.environ["STEPLINE_TASK_ID"].split("-")[1:])
client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
reply = client.chat.completions.create(
    model=os.environ.get("OPENAI_MODEL", "policy"), max_tokens=8,
    messages=[{"role": "user", "content": f"What is {a} plus {b}? Reply with the number only."}],
)
Path(os.environ["STEPLINE_OUT_DIR"], "answer.txt").write_text(reply.choices[0].message.content or "")
