"""Rollout: the actor side of the system (docs/architecture.md, Layout).

It plays harness episodes against the gateway and paces itself against the trainer through the pool:

    config.py     the job file's `[rollout]` table: harness specs, group size, timeouts, pacing
    client.py     the gateway's session API (open a session, post its reward, end it), over HTTP
    worker.py     the client of a long-lived harness worker (`python -m <module>.serve`)
    driver.py     the rollout driver: one session per episode, verifier, reward, end
    pacing.py     rollouts in a background thread, at most `ahead` batches in front of the trainer
    evaluate.py   the test split of every harness through the current policy (`stepline eval`)
    demos.py      the harnesses' scripted experts, played for the SFT warm start

It reaches the system over HTTP and through the pool's interface only, and never imports torch,
the gateway or the trainer (tests/test_architecture.py), so it can run on a machine without them.
"""
