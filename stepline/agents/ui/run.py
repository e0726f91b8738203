"""python -m stepline.agents.ui.run --task ID --out DIR [--max-turns K] [--expert]  ->  DIR/episode.json."""

from stepline.agents.common import run_command
from stepline.agents.ui.harness import MAX_TURNS, NAME, known, play

main = run_command(NAME, play, known, MAX_TURNS)

if __name__ == "__main__":
    main()
