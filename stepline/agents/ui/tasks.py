"""python -m stepline.agents.ui.tasks --split train|test  ->  JSON list of task ids (--kinds: {task id: kind})."""

from stepline.agents.common import tasks_command
from stepline.agents.ui.world import tasks


def split_ids(split: str) -> list[str]:
    return [task.id for task in tasks() if task.split == split]


def kinds(split: str) -> dict[str, str]:
    return {task.id: task.kind for task in tasks() if task.split == split}


main = tasks_command(split_ids, kinds=kinds)

if __name__ == "__main__":
    main()
