"""The two workloads of the speculative-decoding benchmark, as chat messages.

copy: edit a given text or piece of code; the answer repeats much of the prompt, which is
what prompt lookup and a drafter can guess. free: open-ended stories; little to copy.
"""

from __future__ import annotations

_CODE = [
    """def mean(values):
    total = 0
    for v in values:
        total = total + v
    return total / len(values)


def variance(values):
    m = mean(values)
    total = 0
    for v in values:
        total = total + (v - m) * (v - m)
    return total / len(values)""",
    """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def is_empty(self):
        return len(self.items) == 0""",
    """def read_config(path):
    config = {}
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
    return config""",
    """def binary_search(items, target):
    low = 0
    high = len(items) - 1
    while low <= high:
        mid = (low + high) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            low = mid + 1
        else:
            high = mid - 1
    return -1""",
]
_TEXT = [
    "The library opens at nine in the morning and closes at six in the evening. Members "
    "may borrow up to five books at a time for three weeks. Books can be renewed once, "
    "online or at the front desk, unless another member has reserved them. Late returns "
    "cost ten cents a day per book.",
    "Our team meets every Monday at ten to plan the week. Each person says what they "
    "finished last week, what they will work on next, and what is blocking them. The "
    "meeting lasts no more than thirty minutes, and notes are shared in the team channel "
    "by noon.",
    "To make the bread, mix the flour, water, salt and yeast in a large bowl. Knead the "
    "dough for ten minutes until it is smooth, then let it rise for an hour. Shape it into "
    "a loaf, let it rise again for thirty minutes, and bake it at two hundred degrees for "
    "forty minutes.",
    "The train leaves the central station at seven fifteen and arrives at the coast at "
    "nine forty. It stops at four towns on the way. Tickets bought online are cheaper than "
    "tickets bought at the station, and children under twelve travel for half price.",
]
_CODE_TASKS = [
    "Rewrite this Python code with type hints added, and return the whole code:",
    "Add a one-line docstring to every function in this code, and return the whole code:",
]
_TEXT_TASKS = [
    "Repeat this text exactly, but change every number written in words to digits:",
    "Rewrite this text in the past tense, keeping everything else the same:",
]
_STORIES = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a story about a robot that learns to paint.",
    "Tell me a story about two friends who get lost in a forest.",
    "Write a short story about a dragon who is afraid of the dark.",
    "Write a story about a girl who can talk to birds.",
    "Tell me a story about a town where it never stops raining.",
    "Write a short story about an old man and his dog on a long walk.",
    "Write a story about a boy who builds a boat to cross the sea.",
]


def copy_heavy() -> list[list[dict]]:
    """Sixteen edits of given code and text."""
    out = []
    for task in _CODE_TASKS:
        out += [[{"role": "user", "content": f"{task}\n\n{code}"}] for code in _CODE]
    for task in _TEXT_TASKS:
        out += [[{"role": "user", "content": f"{task}\n\n{text}"}] for text in _TEXT]
    return out


def free_text() -> list[list[dict]]:
    """Sixteen open-ended stories."""
    out = [[{"role": "user", "content": s}] for s in _STORIES]
    return out + [[{"role": "user", "content": s + " Make it funny."}] for s in _STORIES]


WORKLOADS = {"copy": copy_heavy, "free": free_text}
