"""python -m stepline.agents.search.tasks --split train|test  ->  JSON list of task ids."""

from stepline.agents.common import tasks_command
from stepline.agents.search.world import tasks


def split_ids(split: str) -> list[str]:
    return [task.id for task in tasks() if task.split == split]


def references(split: str) -> dict[str, str]:
    """Each task's gold answer (the verifier's), for IGPO's information gain."""
    return {task.id: task.answer for task in tasks() if task.split == split}


main = tasks_command(split_ids, references)

if __name__ == "__main__":
    main()
