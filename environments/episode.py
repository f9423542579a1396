"""The step API, token in, token out: `reset()` gives the prompt's token ids; `step(ids)` takes the
model's own token ids, parses a tool call from them, runs it in the episode's sandbox and returns
the observation as token ids to append, exactly as the checkpoint's template renders a tool response
(posttrain.chat). Nothing the model produced is ever re-tokenised.

Thinking (GLM-5): every turn's think block stays in the context of the turns after it (preserved thinking: the
context is the ids as generated, never re-rendered without them), and a turn-level switch decides per turn
whether the model thinks: `thinking_turns` "all", "after_tools" (the first turn, a lightweight tool call, goes
without; turns that read tool results think), or the task's own list (`task.meta["thinking_turns"]`, one flag per
turn, the last repeating). A turn without thinking gets the template's thinking-off generation prompt, so every
mode is token in, token out.

Context compaction (GLM-5.2): with a `context_budget`, an episode whose next turn would not fit closes its
current sub-trace and starts a new one from a fresh prompt, the task with a summary of the tool results so
far: the rule-based note (`compaction_note`), or with `summary="policy"` notes the policy writes itself when
asked (SUMMARY_REQUEST after the last tool response; those tokens close the sub-trace and are trained with it).
Every sub-trace keeps the exact ids and behaviour logprobs it was generated with, so each is a trainable
trajectory; the episode's reward is every sub-trace's. Without compaction the episode is truncated there
(reward 0)."""
from __future__ import annotations

from dataclasses import dataclass, field

import environments
from environments.base import SUMMARY_REQUEST, Task, compacted_prompt, compaction_note, final_answer
from environments.agentic import parse_tool_call
from environments.sandbox import Judge, Workspace
from posttrain.chat import chat_format, ids_around_plain, render_ids, render_text, tool_response_ids


@dataclass
class Trace:
    """One trainable trajectory: a prompt and what followed it, as generated."""
    prompt_ids: list[int]
    ids: list[int]
    gen_mask: list[int]
    logprobs: list[float]
    routes: object = None   # the experts of each position, from the rollout engine (posttrain.routing_replay)
    versions: list[int] | None = None  # the weight version of each of ids (-1: not generated); None: not recorded


@dataclass
class Step:
    obs_ids: list[int]
    done: bool
    reward: float | None = None
    reason: str = ""


@dataclass
class Episode:
    task: Task
    tok: object
    enable_thinking: bool = True
    thinking_turns: str = "all"   # with thinking on: "all" or "after_tools" (the task's meta may say per turn)
    max_turns: int = 3
    judge: Judge | None = None   # the guard's second stage (rules only without one)
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)       # everything after the prompt
    gen_mask: list[int] = field(default_factory=list)  # 1 where the model produced the token
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weight version of each generated token, -1 elsewhere
    last_turn: str = ""
    turns: int = 0
    done: bool = False
    reward: float = 0.0
    reason: str = ""
    blocked: list[dict] = field(default_factory=list)
    context_budget: int = 0    # tokens of context a turn may see, its own generation included (0: no limit)
    compaction: bool = True    # at the budget: compact (a new sub-trace) or truncate (the episode ends, reward 0)
    summary: str = "rules"     # what a compaction carries over: "rules" (compaction_note) or "policy" (its own notes)
    max_new_tokens: int = 48   # a turn's generation budget, counted against context_budget
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (tool, argument, output) so far
    closed: list[Trace] = field(default_factory=list)  # sub-traces ended by compaction
    truncated: bool = False
    summaries: list[str] = field(default_factory=list)  # the policy's notes, one per compaction (summary="policy")
    summary_calls: list[int] = field(default_factory=list)  # how many tool calls each of those notes had to cover
    summarizing: bool = False  # the next generation is the policy's summary
    routes: object = None      # the last turn's experts per position of prompt_ids + ids (routing replay)
    stopped_turns: int = 0     # turns that ended on a stop id (none in a whole batch: a stop-token mismatch)
    _ws: Workspace | None = None

    def __post_init__(self) -> None:
        if self.summary not in ("rules", "policy"):
            raise ValueError(f"summary must be 'rules' or 'policy' (got {self.summary!r})")

    def reset(self) -> list[int]:
        self.prompt_ids = render_ids(self.tok, self.task.messages(), add_generation_prompt=True,
                                     enable_thinking=self.thinks(0))
        env = environments.get(self.task.domain)
        if hasattr(env, "open_workspace"):  # environments with tools
            self._ws = env.open_workspace(self.task, self.judge)
            self._ws.context = {"prompt": self.task.prompt, "calls": self.calls}  # what a judge sees
        return self.prompt_ids

    def thinks(self, turn: int) -> bool:
        """Whether turn `turn` (0: the first) is generated with thinking on."""
        if not self.enable_thinking:
            return False
        per_turn = self.task.meta.get("thinking_turns")
        if per_turn:
            return bool(per_turn[min(turn, len(per_turn) - 1)])
        if self.thinking_turns not in ("all", "after_tools"):
            raise ValueError(f"thinking_turns must be 'all' or 'after_tools' (got {self.thinking_turns!r})")
        return self.thinking_turns == "all" or turn > 0

    @property
    def n_generated(self) -> int:
        return sum(self.gen_mask) + sum(sum(t.gen_mask) for t in self.closed)

    def traces(self) -> list[Trace]:
        """The episode's sub-traces in order: one unless it was compacted (a compaction that left no room for
        another turn leaves no last one)."""
        last = self._trace(len(self.ids))
        return [*self.closed, last] if any(last.gen_mask) or not self.closed else list(self.closed)

    def _trace(self, n: int) -> Trace:
        """The sub-trace of the first n ids (versions only where the engine recorded them)."""
        recorded = any(v >= 0 for v in self.versions[:n])
        return Trace(self.prompt_ids, self.ids[:n], self.gen_mask[:n], self.logprobs[:n], self.routes,
                     self.versions[:n] if recorded else None)

    def _fits(self, obs: int = 0) -> bool:
        """Whether the next turn fits the budget. Where the policy writes the summary, continuing after an
        observation of `obs` tokens also keeps room for a summary after the next one: another observation of that
        size, the request and the summary itself."""
        need = self.max_new_tokens
        if obs and self.compaction and self.summary == "policy":
            need += obs + self._request_len() + self.max_new_tokens
        return not self.context_budget or len(self.prompt_ids) + len(self.ids) + need <= self.context_budget

    def _request_len(self) -> int:
        plain = tool_response_ids(self.tok, "0", enable_thinking=self.thinks(self.turns))
        return len(tool_response_ids(self.tok, "0", enable_thinking=self.thinks(self.turns),
                                     then_user=SUMMARY_REQUEST)) - len(plain)

    def _append(self, ids: list[int], logprobs: list[float] | None = None, generated: bool = False,
                versions: list[int] | None = None) -> None:
        self.ids += ids
        self.gen_mask += [int(generated)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.versions += list(versions) if versions is not None else [-1] * len(ids)

    def _restart(self, note: str) -> bool:
        """The next sub-trace: a fresh prompt, the task and `note`. False when even that does not fit the budget."""
        # the note carries tool results (the world's text) and the policy's own words: plain text, like an observation
        think = self.thinks(self.turns)
        self.prompt_ids = ids_around_plain(
            self.tok, lambda c: render_text(self.tok, [{"role": "user", "content": c}], add_generation_prompt=True,
                                            enable_thinking=think), compacted_prompt(self.task.prompt, note))
        self.ids, self.gen_mask, self.logprobs, self.versions, self.routes = [], [], [], [], None
        return self._fits()

    def _compact(self, n_obs: int) -> bool:
        """Close the sub-trace (without the observation just appended: the note carries it) and start the
        next from the task and the rule-based note."""
        keep = len(self.ids) - n_obs
        self.closed.append(self._trace(keep))
        return self._restart(compaction_note(self.calls))

    def _ask_for_summary(self, n_obs: int, output: str) -> Step:
        """Replace the observation just appended by the same tool response followed by the summary request; the
        policy's next generation is its notes (step)."""
        del self.ids[-n_obs:], self.gen_mask[-n_obs:], self.logprobs[-n_obs:], self.versions[-n_obs:]
        obs_ids = tool_response_ids(self.tok, output, enable_thinking=self.thinks(self.turns),
                                    then_user=SUMMARY_REQUEST)
        self._append(obs_ids)
        if len(self.prompt_ids) + len(self.ids) + self.max_new_tokens > self.context_budget:
            return self._truncate("the summary request")
        self.summarizing = True
        return Step(obs_ids, False)

    def _truncate(self, what: str) -> Step:
        self.truncated = True
        return self._end(0.0, f"truncated: {what} does not fit the context budget of {self.context_budget} tokens")

    def step(self, action_ids: list[int], logprobs: list[float] | None = None, routes=None,
             versions: list[int] | None = None) -> Step:
        """`routes`: the experts the rollout engine chose for this turn's context and tokens (routing replay);
        `versions`: the weight version of each action token, where the engine records them."""
        if self.done:
            raise RuntimeError(f"episode {self.task.id} is over")
        stops = chat_format(self.tok).stop_ids
        self._append(action_ids, logprobs, generated=True, versions=versions)
        self.routes = routes
        stopped = bool(action_ids) and action_ids[-1] in stops
        self.stopped_turns += stopped
        text = self.tok.decode(action_ids[:-1] if stopped else action_ids, skip_special_tokens=False)
        if self.summarizing:  # the policy's notes close this sub-trace, trained with it, and open the next
            self.summarizing = False
            self.summaries.append(final_answer(text))
            self.summary_calls.append(len(self.calls))
            self.closed.append(self._trace(len(self.ids)))
            return Step([], False) if self._restart(self.summaries[-1]) else self._truncate("the next turn")
        self.turns += 1
        self.last_turn = text
        call = parse_tool_call(self.last_turn) if self._ws else None
        if call and self.turns < self.max_turns and stopped:
            output = self._ws.call(*call)
            self.calls.append((*call, output))
            obs_ids = tool_response_ids(self.tok, output, enable_thinking=self.thinks(self.turns))
            self._append(obs_ids)
            if self._fits(len(obs_ids)):
                return Step(obs_ids, False)
            if self.compaction and self.summary == "policy":
                return self._ask_for_summary(len(obs_ids), output)
            if self.compaction and self._compact(len(obs_ids)):
                return Step(obs_ids, False)
            return self._truncate("the next turn")
        return self._end(*environments.get(self.task.domain).verify(self.task, self.last_turn))

    def _end(self, reward: float, reason: str) -> Step:
        self.done, self.reward, self.reason = True, reward, reason
        self.close()
        return Step([], True, reward, reason)

    def close(self) -> None:
        if self._ws is not None:
            self.blocked = list(self._ws.blocked)
            self._ws.close()
            self._ws = None
