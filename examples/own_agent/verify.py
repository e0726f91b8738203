"""The verifier of the example agent: prints one JSON line {"reward", "success", "reason"}.

Reward 1 for the sum alone ("7"), 0.5 for a reply that states it among other words ("3 + 4 = 7"), 0 otherwise:
the partial credit gives a group signal while the policy still answers in sentences.
"""

import json
import os
import re
from pathlib import Path

a, b = (int(x) for x in os.environ["STEPLINE_TASK_ID"].split("-")[1:])
answer_file = Path(os.environ["STEPLINE_OUT_DIR"], "answer.txt")
answer = answer_file.read_text().strip() if answer_file.is_file() else ""
ok = answer == str(a + b)
reward = 1.0 if ok else 0.5 if str(a + b) in re.findall(r"\d+", answer) else 0.0
print(json.dumps({"reward": reward, "success": ok, "reason": f"answer {answer!r}, expected {a + b}"}))
