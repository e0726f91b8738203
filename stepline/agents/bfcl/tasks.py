"""python -m stepline.agents.bfcl.tasks --split train|test  ->  JSON list of task ids (categories.py: the split)."""

from stepline.agents.bfcl.harness import split_ids
from stepline.agents.common import tasks_command

main = tasks_command(split_ids)

if __name__ == "__main__":
    main()
