"""The UI harness: apps, screens, the simulated user, expert, replay verifier and runs through HTTP."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from harness_helpers import cli, endpoint, random_policy, server_policy, verdict

from stepline.agents.common import Episode, ToolCall, ToolError, read_episode, run_episode
from stepline.agents.common.scripted_server import ScriptedServer
from stepline.agents.ui.apps import SECTIONS, AlarmsApp, ContactsApp, ShoppingApp
from stepline.agents.ui.harness import (
    MAX_TURNS,
    SYSTEM,
    ExpertPolicy,
    find_id,
    find_label,
    first_message,
    make_app,
    make_tools,
    play,
    read_down_to,
    replay,
    replay_with_progress,
)
from stepline.agents.ui.tasks import split_ids
from stepline.agents.ui.verify import misread, score
from stepline.agents.ui.world import (
    APP_ORDER,
    Task,
    alarm_text,
    buy_text,
    delete_text,
    favorite_text,
    task_by_id,
    tasks,
    toggle_text,
)

ALARMS = {"alarms": [{"time": t, "on": False} for t in ("06:00", "07:00", "08:00", "09:00")]}


def test_split_is_fixed_and_test_names_are_new() -> None:
    train, test = split_ids("train"), split_ids("test")
    assert (len(train), len(test)) == (320, 80) and not set(train) & set(test)
    assert sorted(task_by_id()[t].app for t in test) == sorted(APP_ORDER * 20)
    done = cli("stepline.agents.ui.tasks", "--split", "test")
    assert done.returncode == 0 and json.loads(done.stdout) == test
    names = lambda split: {c["name"] for t in tasks() if t.split == split and t.app == "contacts" for c in t.data["contacts"]}  # noqa: E731
    assert not names("train") & names("test")


def test_screen_render_scroll_and_invalid_actions() -> None:
    app = AlarmsApp(ALARMS)
    assert app.render() == ("Alarms\n[1] switch 06:00: off\n[2] switch 07:00: off\n[3] switch 08:00: off\n(more below)\n"
                            "[5] field New alarm: \n[6] button Add")
    with pytest.raises(ToolError, match="no element 4 on screen"):
        app.tap(4)  # scrolled out
    assert app.scroll("down").splitlines()[1:3] == ["(more above)", "[2] switch 07:00: off"]
    app.tap(4)
    assert app.data["alarms"][3]["on"] is True
    with pytest.raises(ToolError, match="not a field"):
        app.type(6, "x")
    app.type(5, "25:00")
    with pytest.raises(ToolError, match="invalid time"):
        app.tap(6)
    assert len(app.data["alarms"]) == 4  # an invalid action changes nothing
    with pytest.raises(ToolError, match="direction must be up or down"):
        app.scroll("left")
    with pytest.raises(ToolError, match="already on the first screen"):
        app.back()
    app.type(5, "05:30")
    app.tap(6)
    assert app.data["alarms"][0] == {"time": "05:30", "on": True}


def test_contacts_and_shopping_navigation() -> None:
    contacts = ContactsApp({"contacts": [{"name": "Kalo", "phone": "555-0100", "favorite": False}]})
    assert contacts.tap(1) == "Kalo\n[1] text Phone: 555-0100\n[2] switch Favorite: off\n[3] button Delete"
    with pytest.raises(ToolError, match="not tappable"):
        contacts.tap(1)
    assert contacts.tap(3) == "Contacts" and contacts.data["contacts"] == []
    shop = ShoppingApp({"products": ["Kalomi tea"], "cart": {}})
    shop.tap(1)
    shop.type(2, "3")
    assert shop.tap(3).splitlines()[1:3] == ["[1] text In cart: 3", "[2] field Quantity: 1"]
    assert shop.back() == "Shop\n[1] button Kalomi tea"


def test_simulated_user_gives_the_withheld_detail_only_when_asked() -> None:
    task = task_by_id()["ui-0005"]
    assert (task.instruction, task.user_reply) == ("Add an alarm.", "06:15")
    tools = {tool.name: tool for tool in make_tools(make_app(task), task)}
    assert tools["ask_user"].fn(question="What time?") == "06:15"
    other = task_by_id()["ui-0001"]
    assert {t.name: t for t in make_tools(make_app(other), other)}["ask_user"].fn(question="?") == "Just do what I asked."


def test_expert_solves_every_test_task_in_at_most_three_actions() -> None:
    for task_id in split_ids("test"):
        episode = play(task_id, MAX_TURNS, expert=True)
        assert score(task_id, episode).success, task_id
        assert len(episode.calls) <= 3 and episode.final == "Done."


def test_expert_reads_the_screen_down_to_the_element_before_acting_on_it() -> None:
    # each action follows the screen's lines copied from the top down to the element it acts on, then a sentence
    # with its label: the id a model writes is the one it copied last (the demo a model copies)
    said = []
    for task_id in split_ids("test"):
        episode = play(task_id, MAX_TURNS, expert=True)
        screen = episode.messages[1]["content"].split("\n\n", 1)[1]
        for message, result in zip(episode.messages[2::2], episode.messages[3::2]):
            (call,) = message["tool_calls"]
            name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
            if name in ("tap", "type"):
                label = find_label(screen, args["id"])
                *read, sentence = message["content"].split("\n")
                assert read == screen.split("\n")[1 : len(read) + 1] and read[-1].startswith(f"[{args['id']}] ")
                assert sentence == (f"Tap {label}." if name == "tap" else f"Type {args['text']} into {label}.")
            elif name == "scroll":
                assert message["content"].endswith(" is not shown: scroll down.")
            said.append(name)
            if name != "ask_user":
                screen = result["content"]
    assert {"tap", "type", "scroll", "ask_user"} <= set(said)


def _random_call(rng: random.Random) -> tuple[str, dict]:
    return rng.choice([
        ("tap", {"id": rng.randint(1, 6)}), ("type", {"id": rng.randint(1, 6), "text": rng.choice(["07:30", "2"])}),
        ("scroll", {"direction": rng.choice(["up", "down"])}), ("back", {}), ("ask_user", {"question": "?"}),
    ])


def test_random_policy_scores_near_zero() -> None:
    rng = random.Random(0)
    rewards = []
    for task_id in split_ids("test"):
        task = task_by_id()[task_id]
        app = make_app(task)
        episode = run_episode(random_policy(rng, [_random_call]), Episode(harness="ui", task_id=task_id), system=SYSTEM,
                              user=f"{task.instruction}\n\n{app.render()}", tools=make_tools(app, task), max_turns=MAX_TURNS)
        episode.state = {"data": app.data}
        rewards.append(score(task_id, episode).reward)
    assert sum(rewards) / len(rewards) < 0.1


def test_verifier_replays_actions_and_rejects_a_forged_state() -> None:
    episode = play("ui-0004", MAX_TURNS, expert=True)
    assert score("ui-0004", episode).reason == "settings state matches the goal"
    episode.state["data"]["toggles"]["Wi-Fi"] = not episode.state["data"]["toggles"]["Wi-Fi"]
    assert score("ui-0004", episode).reason == "the recorded app state differs from the replayed actions"
    claimed = Episode(harness="ui", task_id="ui-0004", final="Done.", finish="final_message")
    assert score("ui-0004", claimed).reason == "settings state unchanged (0 of 2 plan steps)"


def _episode(task_id: str, *calls: tuple[str, dict]) -> Episode:
    """An episode whose recorded actions are `calls`, its state what they leave (as the harness records it)."""
    task = task_by_id()[task_id]
    recorded = [ToolCall(turn=i, name=name, arguments=args) for i, (name, args) in enumerate(calls)]
    return Episode(harness="ui", task_id=task_id, calls=recorded, finish="final_message", final="Done.",
                   state={"data": replay(task, recorded).data})


def test_partial_credit_counts_the_plan_steps_reached_in_order() -> None:
    # ui-0004 "Turn on Do not disturb.": Sound is [2] on the first screen
    assert score("ui-0004", _episode("ui-0004")).reward == 0.0
    section = score("ui-0004", _episode("ui-0004", ("tap", {"id": 2})))
    assert (section.reward, section.success) == (0.25, False)
    assert section.reason == "settings state unchanged (1 of 2 plan steps)"
    assert score("ui-0004", _episode("ui-0004", ("tap", {"id": 1}))).reward == 0.0  # Display: the wrong section
    assert score("ui-0004", _episode("ui-0004", ("tap", {"id": 1}), ("back", {}), ("tap", {"id": "2"}))).reward == 0.25
    # a wrong toggle in the right section keeps the section's credit, and is a changed state
    sound = make_app(task_by_id()["ui-0004"])
    sound.tap(2)
    other = next(i for i in range(1, 9) if (label := find_label(sound.render(), i)) and label != "Do not disturb")
    wrong = score("ui-0004", _episode("ui-0004", ("tap", {"id": 2}), ("tap", {"id": other})))
    assert (wrong.reward, wrong.reason) == (0.25, "settings state changed, but not as asked (1 of 2 plan steps)")
    # ui-0002 "Add my coach to favorites." (ask, tap the user's answer, tap Favorite): asking counts, in order only
    asked = _episode("ui-0002", ("ask_user", {"question": "Who?"}))
    assert score("ui-0002", asked).reward == pytest.approx(0.5 / 3)
    coach = find_id(make_app(task_by_id()["ui-0002"]).render(), "Ravera")
    assert score("ui-0002", _episode("ui-0002", ("tap", {"id": coach}))).reward == 0.0  # tapped before asking
    both = _episode("ui-0002", ("ask_user", {"question": "Who?"}), ("tap", {"id": coach}))
    assert score("ui-0002", both).reward == pytest.approx(1 / 3)
    expert = play("ui-0002", MAX_TURNS, expert=True)
    assert (score("ui-0002", expert).reward, len(replay_with_progress(task_by_id()["ui-0002"], expert.calls)[1])) == (1.0, 3)


def test_model_episode_through_the_openai_sdk_then_cli_verify(tmp_path: Path) -> None:
    task = task_by_id()["ui-0003"]  # an ask-the-user shopping task
    with ScriptedServer(server_policy(ExpertPolicy(task, make_app(task).render()))) as server:
        done = cli("stepline.agents.ui.run", "--task", task.id, "--out", str(tmp_path), "--max-tokens", "64",
                   env=endpoint(server.openai_base_url))
    assert done.returncode == 0, done.stderr
    assert verdict("ui", task.id, tmp_path).success
    episode = read_episode(tmp_path)
    assert [c.name for c in episode.calls] == ["ask_user", "tap", "tap"] and episode.finish == "final_message"
    assert [t["function"]["name"] for t in server.requests[0]["tools"]] == ["tap", "type", "scroll", "back", "ask_user"]
    assert {r["max_tokens"] for r in server.requests} == {64}
    assert server.requests[-1]["messages"] == episode.messages[:-1]  # the full history, echoed each turn


def test_expert_cli_and_a_down_endpoint(tmp_path: Path) -> None:
    assert cli("stepline.agents.ui.run", "--task", "ui-0009", "--out", str(tmp_path / "x"), "--expert").returncode == 0
    assert score("ui-0009", read_episode(tmp_path / "x")).success
    down = cli("stepline.agents.ui.run", "--task", "ui-0009", "--out", str(tmp_path / "d"), env=endpoint("http://127.0.0.1:9/v1"))
    assert down.returncode == 1 and "APIConnectionError" in read_episode(tmp_path / "d").error


def test_a_success_whose_reading_disagrees_with_its_action_trains_as_zero() -> None:
    # an id that reaches the goal after naming another element is a guess: scored a success, trained as 0
    task_id = next(t.id for t in tasks() if t.kind == "buy" and t.split == "test")
    episode = play(task_id, MAX_TURNS, expert=True)
    assert score(task_id, episode).train_reward is None  # the expert's reading agrees with every action
    first = next(m for m in episode.messages if m["role"] == "assistant")
    *read, said = first["content"].split("\n")
    first["content"] = "\n".join([*read, "Tap Somebody else."])
    verdict = score(task_id, episode)
    assert verdict.success and verdict.reward == 1.0 and verdict.train_reward == 0.0
    assert "after 'Tap Somebody else.'" in str(misread(task_by_id()[task_id], episode))
    first["content"] = "\n".join(["[1] button Not on the screen", said])
    assert "reads '[1] button Not on the screen'" in str(misread(task_by_id()[task_id], episode))
    assert score(task_id, episode).train_reward == 0.0


def test_partial_credit_is_also_given_at_the_turn_that_earned_it() -> None:
    # ui-0004 "Turn on Do not disturb.": the expert opens Sound (turn 0), then taps the switch (turn 1)
    task = task_by_id()["ui-0004"]
    expert = play(task.id, MAX_TURNS, expert=True)
    assert score(task.id, expert).step_rewards == {0: 0.25, 1: 0.25}
    # the right section, then a wrong switch, both read off their screens: the credit stays with turn 0
    app = make_app(task)
    first = app.render()
    app.tap(2)
    other = next(i for i in range(1, 9) if (label := find_label(app.render(), i)) and label != "Do not disturb")
    wrong = _episode(task.id, ("tap", {"id": 2}), ("tap", {"id": other}))
    wrong.messages = [{"role": "assistant", "content": "\n".join([*read_down_to(first, 2), "Tap Sound."])},
                      {"role": "assistant", "content": "\n".join([*read_down_to(app.render(), other),
                                                                  f"Tap {find_label(app.render(), other)}."])}]
    verdict = score(task.id, wrong)
    assert (verdict.reward, verdict.train_reward, verdict.step_rewards) == (0.25, None, {0: 0.25})
    # a reading that disagrees with the tap earns neither the score nor the step's credit in training
    wrong.messages[0]["content"] = "Tap Display."
    verdict = score(task.id, wrong)
    assert (verdict.reward, verdict.train_reward, verdict.step_rewards) == (0.25, 0.0, None)


def _expert_on(task: Task, instruction: str, plan: tuple[tuple[str, ...], ...]) -> Episode:
    """The expert's episode on `task`'s start, carrying out another instruction (its plan) instead of the task's."""
    other = replace(task, instruction=instruction, plan=plan)
    app = make_app(other)
    episode = Episode(harness="ui", task_id=task.id, expert=True)
    run_episode(ExpertPolicy(other, app.render()), episode, system=SYSTEM, user=first_message(instruction, app.render()),
                tools=make_tools(app, other), max_turns=MAX_TURNS)
    episode.state = {"data": app.data}
    return episode


def _sibling(task: Task) -> tuple[str, tuple[tuple[str, ...], ...]]:
    """Another task of the same kind from the same start: what a policy that read the wrong line did."""
    data = task.data
    if task.kind == "toggle":
        section, toggle = next((s, t) for s, ts in SECTIONS.items() for t in ts if t != task.plan[1][1])
        return toggle_text(toggle, not data["toggles"][toggle]), (("tap", section), ("tap", toggle))
    if task.kind == "switch":
        alarm = next(a for a in data["alarms"] if a["time"] != task.plan[0][1])
        return alarm_text(alarm["time"], not alarm["on"]), (("tap", alarm["time"]),)
    if task.kind in ("favorite", "delete"):
        contact = next(c for c in data["contacts"] if c["name"] != task.plan[0][1] and not c["favorite"])
        text = favorite_text if task.kind == "favorite" else delete_text
        return text(contact["name"]), (("tap", contact["name"]), ("tap", task.plan[1][1]))
    product = next(p for p in data["products"] if p != task.plan[0][1])
    if task.kind == "quantity":
        return buy_text(product, 3), (("tap", product), ("type", "Quantity", "3"), ("tap", "Add to cart"))
    return buy_text(product), (("tap", product), ("tap", "Add to cart"))


@pytest.mark.parametrize("kind", ["toggle", "switch", "favorite", "delete", "buy", "quantity"])
def test_a_failed_episode_is_relabelled_with_the_instruction_it_carried_out(kind: str) -> None:
    task = next(t for t in tasks() if t.kind == kind and t.split == "train"
                and ("contacts" not in t.data or sum(not c["favorite"] for c in t.data["contacts"]) >= 2))
    instruction, plan = _sibling(task)
    episode = _expert_on(task, instruction, plan)  # read as the expert reads, on the wrong element
    verdict = score(task.id, episode)
    assert not verdict.success
    assert verdict.hindsight == first_message(instruction, make_app(task).render()) == episode.messages[1]["content"]
    assert score(task.id, play(task.id, MAX_TURNS, expert=True)).hindsight is None  # a success needs no relabel


def test_hindsight_needs_one_describable_change_read_off_the_screen() -> None:
    task = task_by_id()["ui-0004"]  # "Turn on Do not disturb.": Sound is [2] on the first screen
    assert score(task.id, _episode(task.id)).hindsight is None  # nothing changed
    assert score(task.id, _episode(task.id, ("tap", {"id": 2}))).hindsight is None  # opened a section only
    app = make_app(task)
    app.tap(2)
    switches = [i for i in range(1, 9) if find_label(app.render(), i) not in (None, "Do not disturb")]
    both = _expert_on(task, "Turn two switches.", (("tap", "Sound"), ("tap", find_label(app.render(), switches[0])),
                                                    ("tap", find_label(app.render(), switches[1]))))
    assert score(task.id, both).hindsight is None  # two changes: no one task of the world did that
    instruction, plan = _sibling(task)
    guessed = _expert_on(task, instruction, plan)
    guessed.messages[2]["content"] = "Tap Somewhere."  # the section's tap not read off the screen
    assert score(task.id, guessed).hindsight is None
    asked = _expert_on(task, instruction, (("ask", "Which one?"), *plan[:2]))
    assert asked.calls[0].name == "ask_user" and score(task.id, asked).hindsight is None
