"""TRL 1.16's `environment_factory`: an object per rollout whose methods are the model's tools.

    class Counter:
        def reset(self, **row) -> str | None:      # called with the dataset row before the rollout
            self.n = 0
            return "The counter is at 0."          # appended to the prompt's last message (None: nothing)

        def increment(self, by: int) -> int:
            \"\"\"Add to the counter.

            Args:
                by: How much to add.
            \"\"\"
            self.n += by
            return self.n

        def get_reward(self) -> float:             # optional: the environment scores its rollout
            return float(self.n == 3)

    GRPOTrainer(model=..., environment_factory=Counter, reward_funcs=[...], train_dataset=rows)

As TRL builds them: one instance per completion, drawn from a pool that grows to the largest round and is reused
(`reset` again) in later rounds; the public methods (not `reset` / `get_reward`, not underscored) join `tools=` and
are called on that completion's instance; `get_reward` becomes a reward function named after the class (weight
1) given every completion's environment; reward functions receive `environments=` too. A dict of factories
routes each row by its `environment` column, and each row's prompt lists only its environment's tools.

An environment that raises in `reset` or `get_reward` is one line in the run's log: the rollout goes on without
the observation, and that completion's environment reward is None (left out, as TRL leaves out None rewards).
"""

from __future__ import annotations

import asyncio
import inspect

from ...errors import first_line

__all__ = ["Environments"]

_CONTROL = ("reset", "get_reward")


async def _awaited(awaitable):
    return await awaitable


def _public_methods(instance) -> list:
    # listed on the class: getmembers on the instance would evaluate properties
    return [getattr(instance, n) for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if n not in _CONTROL and not n.startswith("_")]


class Environments:
    """The run's environment factories, their pools and the tools they expose."""

    def __init__(self, factory, standalone_tools: list):
        self.multi = isinstance(factory, dict)
        self.factories = dict(factory) if self.multi else {None: factory}
        self.standalone = list(standalone_tools)
        self.pool: dict = {}
        self.tools: dict = {}  # environment name -> the tools its rows see (standalone first)
        self.reward_types: list[type] = []
        for name, make in self.factories.items():
            if not callable(make):
                raise ValueError(f"environment_factory{'' if name is None else f'[{name!r}]'} is not callable: give "
                                 "a class or a function returning an environment")
            instance = self._make(name)
            if not callable(getattr(instance, "reset", None)):
                raise ValueError("Each environment instance returned by `environment_factory` must define a callable "
                                 f"`reset` ({type(instance).__name__} has none)")
            self.tools[name] = self.standalone + _public_methods(instance)
            self.pool[name] = [instance]
            if callable(getattr(instance, "get_reward", None)) and type(instance) not in self.reward_types:
                self.reward_types.append(type(instance))

    def _make(self, name):
        try:
            return self.factories[name]()
        except Exception as e:
            raise ValueError(f"environment_factory{'' if name is None else f'[{name!r}]'}() raised "
                             f"{type(e).__name__}: {first_line(e)}") from e

    def all_tools(self) -> list:
        """Every tool any environment exposes (the union TRL keeps as `self.tools`)."""
        out = list(self.standalone)
        for tools in self.tools.values():
            out += [t for t in tools if all(t.__name__ != u.__name__ for u in out)]
        return out

    def name_of(self, row: dict, index: int):
        if not self.multi:
            return None
        name = row.get("environment")
        if name not in self.factories:
            raise ValueError(f"row {index}: environment={name!r} is not among the environments passed to "
                             f"environment_factory (expected one of: {', '.join(map(repr, self.factories))})")
        return name

    def draw(self, names: list) -> list:
        """One instance per completion, from each environment's pool (grown when a round needs more)."""
        cursor: dict = {}
        out = []
        for name in names:
            pool = self.pool[name]
            i = cursor.get(name, 0)
            if i == len(pool):
                pool.append(self._make(name))
            cursor[name] = i + 1
            out.append(pool[i])
        return out

    def reset(self, instance, row: dict, warn) -> object:
        """instance.reset(**row) (the row less its `environment` column with several environments): the
        observation, or None (also when reset raises: noted through `warn(kind, detail)`)."""
        kwargs = {k: v for k, v in row.items() if k != "environment"} if self.multi else dict(row)
        try:
            return instance.reset(**kwargs)
        except Exception as e:  # noqa: BLE001 - the rollout goes on without its observation
            warn(f"environment {type(instance).__name__}.reset raised {type(e).__name__}", first_line(e))
            return None

    @staticmethod
    def observed(prompt: list, observation) -> list:
        """The prompt with the observation appended to its last message's content (TRL's: text to text, text
        blocks to block lists)."""
        if observation is None:
            return prompt
        content = prompt[-1]["content"]
        if isinstance(observation, list) and isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if isinstance(observation, str) and isinstance(content, list):
            observation = [{"type": "text", "text": observation}]
        return [*prompt[:-1], {**prompt[-1], "content": content + observation}]

    def bound(self, instance) -> dict:
        """name -> callable: the standalone tools and this instance's methods."""
        return {t.__name__: t for t in self.standalone + _public_methods(instance)}

    def reward_funcs(self, warn) -> list:
        """(name, function) per environment class with a `get_reward`: TRL's extra reward sources."""
        out = []
        for env_type in self.reward_types:
            def get_reward(environments, _type=env_type, **kwargs):
                scores = []
                for e in environments:
                    if type(e) is not _type:
                        scores.append(None)
                        continue
                    try:
                        value = e.get_reward()
                        scores.append(asyncio.run(_awaited(value)) if inspect.isawaitable(value) else value)
                    except Exception as err:  # noqa: BLE001 - that completion is left unscored
                        warn(f"environment {_type.__name__}.get_reward raised {type(err).__name__}",
                             first_line(err))
                        scores.append(None)
                return scores

            get_reward.__name__ = env_type.__name__
            out.append((env_type.__name__, get_reward))
        return out
