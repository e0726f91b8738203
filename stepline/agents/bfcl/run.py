"""python -m stepline.agents.bfcl.run --task ID --out DIR [--max-turns K] [--expert]  ->  DIR/episode.json."""

from stepline.agents.bfcl.harness import MAX_TURNS, NAME, known, play
from stepline.agents.common import run_command

main = run_command(NAME, play, known, MAX_TURNS)

if __name__ == "__main__":
    main()
