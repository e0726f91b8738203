"""`stepline dashboard`: a read-only web view of a run or a pool (aiohttp, plain HTML + JS, uPlot charts).

    runfiles.py   what a run directory holds (metrics, evaluations, rollouts, the job's leaf rule, tokenizer)
    sessions.py   the episodes table: one summary row per session, refreshed, filtered and paged
    runview.py    the run view's chart series (pure)
    episode.py    one session's tree of steps as JSON, decoded token by token
    app.py        the aiohttp application (JSON API, static page, access token)
    cli.py        the command
"""
