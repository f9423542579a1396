"""The step API, token in, token out: `reset()` gives the prompt's token ids; `step(ids)` takes the
model's own token ids, parses a tool call from them, runs it in the episode's sandbox and returns
the observation as token ids to append, exactly as the checkpoint's template renders a tool response
(posttrain.chat). Nothing the model produced is ever re-tokenised."""
from __future__ import annotations

from dataclasses import dataclass, field

import environments
from environments.base import Task
from environments.agentic import parse_tool_call
from environments.sandbox import Judge, Workspace, path_judge
from posttrain.chat import chat_format, render_ids, tool_response_ids


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
    max_turns: int = 3
    judge: Judge = path_judge
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)       # everything after the prompt
    gen_mask: list[int] = field(default_factory=list)  # 1 where the model produced the token
    logprobs: list[float] = field(default_factory=list)
    last_turn: str = ""
    turns: int = 0
    done: bool = False
    reward: float = 0.0
    reason: str = ""
    blocked: list[dict] = field(default_factory=list)
    _ws: Workspace | None = None

    def reset(self) -> list[int]:
        self.prompt_ids = render_ids(self.tok, self.task.messages(), add_generation_prompt=True,
                                     enable_thinking=self.enable_thinking)
        env = environments.get(self.task.domain)
        if hasattr(env, "open_workspace"):  # environments with tools
            self._ws = env.open_workspace(self.task, self.judge)
        return self.prompt_ids

    @property
    def n_generated(self) -> int:
        return sum(self.gen_mask)

    def step(self, action_ids: list[int], logprobs: list[float] | None = None) -> Step:
        if self.done:
            raise RuntimeError(f"episode {self.task.id} is over")
        stops = chat_format(self.tok).stop_ids
        self.ids += action_ids
        self.gen_mask += [1] * len(action_ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(action_ids)
        self.turns += 1
        stopped = bool(action_ids) and action_ids[-1] in stops
        self.last_turn = self.tok.decode(action_ids[:-1] if stopped else action_ids, skip_special_tokens=False)
        call = parse_tool_call(self.last_turn) if self._ws else None
        if call and self.turns < self.max_turns and stopped:
            obs_ids = tool_response_ids(self.tok, self._ws.call(*call), enable_thinking=self.enable_thinking)
            self.ids += obs_ids
            self.gen_mask += [0] * len(obs_ids)
            self.logprobs += [0.0] * len(obs_ids)
            return Step(obs_ids, False)
        self.done = True
        self.reward, self.reason = environments.get(self.task.domain).verify(self.task, self.last_turn)
        self.close()
        return Step([], True, self.reward, self.reason)

    def close(self) -> None:
        if self._ws is not None:
            self.blocked = list(self._ws.blocked)
            self._ws.close()
            self._ws = None
