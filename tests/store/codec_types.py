"""Subclasses and enums the codec tests refuse or keep exact: one definition for every codec test module."""

from __future__ import annotations

import enum


class Color(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 2


class Tag(str):
    pass


class Count(int):
    pass


class Ratio(float):
    pass


class MyDict(dict):
    pass


class MyList(list):
    pass
