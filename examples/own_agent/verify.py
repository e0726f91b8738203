"""The verifier of the example agent: prints one JSON line {"reward", "success", "reason"}."""

import json
import os
from pathlib import Path

a, b = (int(x) for x in os.environ["STEPLINE_TASK_ID"].split("-")[1:])
answer_file = Path(os.environ["STEPLINE_OUT_DIR"], "answer.txt")
answer = answer_file.read_text().strip() if answer_file.is_file() else ""
ok = answer == str(a + b)
print(json.dumps({"reward": float(ok), "success": ok, "reason": f"answer {answer!r}, expected {a + b}"}))
