"""`gsm8k-synth`: grade-school word problems made in code, in verl's GSM8K parquet layout.

No dataset can be downloaded here, so this maker writes problems of GSM8K's kind — two or three
arithmetic steps wrapped in a short story with varied names, objects and numbers — exactly as
verl's `examples/data_preprocess/gsm8k.py` lays out the real one:

    data_source   "openai/gsm8k"          (so the same GSM8K scorer applies)
    prompt        [{"role": "user", "content": question + INSTRUCTION}]
    ability       "math"
    reward_model  {"style": "rule", "ground_truth": "<integer>"}
    extra_info    {"split", "index", "answer": worked solution ending "#### N", "question"}

so a user's real GSM8K parquet files load and score unchanged. Every answer is a non-negative
integer, every intermediate value too (no fractions, no negative counts).

`gsm8k-synth-1step` is the same maker at one arithmetic step per problem with the instruction
"Answer with the number only." instead of verl's: the level a ~100M-parameter model learns.

    dagrl data make gsm8k-synth --out data/gsm8k-synth
    dagrl data make gsm8k-synth-1step --out data/gsm8k-1step
"""

from __future__ import annotations

import random
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pyarrow as pa

from dagrl.data.parquet_write import check_int, write_parquet_atomic

# The instruction verl's GSM8K preprocessing appends to every question.
INSTRUCTION = " Let's think step by step and output the final answer after \"####\"."
# The one-step level's: a 135M model told to think step by step rambles past its token budget.
SHORT_INSTRUCTION = " Answer with the number only."

_SCHEMA = pa.schema([
    ("data_source", pa.string()),
    ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ("ability", pa.string()),
    ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
    ("extra_info", pa.struct([("split", pa.string()), ("index", pa.int64()),
                              ("answer", pa.string()), ("question", pa.string())])),
])

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gus", "Hana", "Ivan", "Jade", "Kofi",
         "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Victor",
         "Wen", "Yusuf", "Zoe"]
ITEMS = ["apples", "stickers", "marbles", "pencils", "cookies", "books", "shells", "cards",
         "stamps", "beads", "oranges", "crayons"]
CONTAINERS = ["boxes", "bags", "packs", "jars", "baskets"]


class _Problem:
    """A question and its worked solution, built step by step (GSM8K's `<<a*b=c>>` notes)."""

    def __init__(self, question: str) -> None:
        self.question, self.lines = question, []

    def step(self, text: str, expression: str, value: int) -> int:
        assert value >= 0 and value == int(value), (expression, value)   # maker invariant
        self.lines.append(f"{text} {expression} = <<{expression}={value}>>{value}.")
        return value

    def solution(self, answer: int) -> str:
        return "\n".join([*self.lines, f"#### {answer}"])


# Each template draws its numbers from `r` and returns (problem, answer). `hi` bounds the
# numbers a template draws (difficulty).
def _packs_given_away(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, item, box = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    packs, per = r.randint(2, 9), r.randint(2, hi)
    gift = r.randint(1, packs * per - 1)
    p = _Problem(f"{name} buys {packs} {box} of {item}. Each of the {box} holds {per} {item}. "
                 f"{name} gives {gift} {item} to a friend. How many {item} does {name} have left?")
    total = p.step(f"{name} buys", f"{packs}*{per}", packs * per)
    return p, p.step("After the gift there are", f"{total}-{gift}", total - gift)


def _hourly_pay(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, rate = r.choice(NAMES), r.randint(5, hi + 5)
    mon, tue = r.randint(2, 9), r.randint(2, 9)
    p = _Problem(f"{name} earns ${rate} an hour. {name} works {mon} hours on Monday and {tue} "
                 f"hours on Tuesday. How many dollars does {name} earn in the two days?")
    hours = p.step(f"{name} works", f"{mon}+{tue}", mon + tue)
    return p, p.step(f"{name} earns", f"{hours}*{rate}", hours * rate)


def _change_back(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    count, price = r.randint(2, 9), r.randint(1, max(2, hi // 2))
    bill = next(b for b in (10, 20, 50, 100, 200, 500) if b >= count * price)
    p = _Problem(f"{name} buys {count} {item} that cost ${price} each and pays with a ${bill} "
                 f"bill. How many dollars of change does {name} get?")
    cost = p.step("The cost is", f"{count}*{price}", count * price)
    return p, p.step(f"{name} gets back", f"{bill}-{cost}", bill - cost)


def _pages_left(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, per_day, days = r.choice(NAMES), r.randint(2, hi), r.randint(2, 7)
    pages = per_day * days + r.randint(0, 5 * hi)
    p = _Problem(f"A book has {pages} pages. {name} reads {per_day} pages every day for {days} "
                 "days. How many pages are still left to read?")
    read = p.step(f"{name} reads", f"{per_day}*{days}", per_day * days)
    return p, p.step("Left to read:", f"{pages}-{read}", pages - read)


def _ages(r: random.Random, hi: int) -> tuple[_Problem, int]:
    a, b = r.sample(NAMES, 2)
    age, gap, years = r.randint(3, 12), r.randint(2, hi), r.randint(2, 10)
    p = _Problem(f"{a} is {age} years old. {b} is {gap} years older than {a}. How old will {b} "
                 f"be in {years} years?")
    now = p.step(f"{b} is now", f"{age}+{gap}", age + gap)
    return p, p.step(f"In {years} years {b} will be", f"{now}+{years}", now + years)


def _share_then_buy(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    friends, each, more = r.randint(2, 6), r.randint(2, hi), r.randint(1, hi)
    total = friends * each
    p = _Problem(f"{name} has {total} {item} and shares them equally among {friends} friends. "
                 f"One friend then buys {more} more {item}. How many {item} does that friend "
                 "have now?")
    share = p.step("Each friend gets", f"{total}/{friends}", each)
    return p, p.step("That friend has", f"{share}+{more}", share + more)


def _bake_and_bag(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name = r.choice(NAMES)
    trays, per_tray, bag = r.randint(2, 5), r.randint(3, hi + 3), r.randint(2, 6)
    total = trays * per_tray
    eaten = total % bag or bag           # what is left then fills whole bags
    if eaten >= total:
        eaten = total % bag
    p = _Problem(f"{name} bakes {trays} trays of {per_tray} cookies. {name} eats {eaten} of them "
                 f"and packs the rest into bags of {bag}. How many bags does {name} fill?")
    baked = p.step(f"{name} bakes", f"{trays}*{per_tray}", total)
    rest = p.step("After eating there are", f"{baked}-{eaten}", baked - eaten)
    return p, p.step(f"{name} fills", f"{rest}/{bag}", rest // bag)


def _savings_weeks(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name = r.choice(NAMES)
    thing = r.choice(["bike", "game", "jacket", "tent", "guitar", "scooter"])
    weekly, weeks, saved = r.randint(3, hi), r.randint(2, 12), r.randint(5, 60)
    price = saved + weekly * weeks
    p = _Problem(f"{name} wants a {thing} that costs ${price}. {name} has saved ${saved} and "
                 f"saves ${weekly} more every week. How many weeks until {name} can buy it?")
    need = p.step(f"{name} still needs", f"{price}-{saved}", price - saved)
    return p, p.step("That takes", f"{need}/{weekly}", need // weekly)


def _rows_of_plants(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name = r.choice(NAMES)
    plant = r.choice(["tulips", "tomato plants", "roses", "carrots", "sunflowers"])
    rows, per_row, extra_rows = r.randint(2, 9), r.randint(2, hi), r.randint(1, 4)
    p = _Problem(f"{name} plants {rows} rows of {plant} with {per_row} in each row. Then "
                 f"{name} adds {extra_rows} more rows of the same size. How many {plant} are "
                 "there in all?")
    all_rows = p.step("There are", f"{rows}+{extra_rows}", rows + extra_rows)
    return p, p.step("In all there are", f"{all_rows}*{per_row}", all_rows * per_row)


# One-step problems: the `steps=1` level, for models too small to learn GSM8K's two- and
# three-step kind (SmolLM2-135M answers ~2% of those greedily, ~20% of these with the short
# instruction: enough right samples for GRPO to learn from).
def _buys_more(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    have, more = r.randint(2, 4 * hi), r.randint(2, 4 * hi)
    p = _Problem(f"{name} has {have} {item}. {name} buys {more} more {item}. How many {item} "
                 f"does {name} have now?")
    return p, p.step(f"{name} has", f"{have}+{more}", have + more)


def _gives_away(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, friend, item = *r.sample(NAMES, 2), r.choice(ITEMS)
    have = r.randint(5, 5 * hi)
    gift = r.randint(1, have - 1)
    p = _Problem(f"{name} has {have} {item} and gives {gift} of them to {friend}. How many "
                 f"{item} does {name} have left?")
    return p, p.step(f"{name} has left", f"{have}-{gift}", have - gift)


def _boxes_in_all(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, item, box = r.choice(NAMES), r.choice(ITEMS), r.choice(CONTAINERS)
    packs, per = r.randint(2, 9), r.randint(2, hi)
    p = _Problem(f"{name} has {packs} {box} of {item} with {per} {item} in each. How many "
                 f"{item} does {name} have in all?")
    return p, p.step("In all there are", f"{packs}*{per}", packs * per)


def _equal_shares(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, item = r.choice(NAMES), r.choice(ITEMS)
    friends, each = r.randint(2, 6), r.randint(2, hi)
    p = _Problem(f"{name} shares {friends * each} {item} equally among {friends} friends. How "
                 f"many {item} does each friend get?")
    return p, p.step("Each friend gets", f"{friends * each}/{friends}", each)


def _one_day_pay(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, rate, hours = r.choice(NAMES), r.randint(5, hi + 5), r.randint(2, 9)
    p = _Problem(f"{name} earns ${rate} an hour and works {hours} hours. How many dollars does "
                 f"{name} earn?")
    return p, p.step(f"{name} earns", f"{hours}*{rate}", hours * rate)


def _age_later(r: random.Random, hi: int) -> tuple[_Problem, int]:
    name, age, years = r.choice(NAMES), r.randint(3, 12), r.randint(2, hi)
    p = _Problem(f"{name} is {age} years old. How old will {name} be in {years} years?")
    return p, p.step(f"In {years} years {name} will be", f"{age}+{years}", age + years)


# Each template with its number of arithmetic steps (the `steps` option picks levels). The
# order is fixed: a seed gives the same problems for the same `steps`.
TEMPLATES: list[tuple[int, Callable[[random.Random, int], tuple[_Problem, int]]]] = [
    (2, _packs_given_away), (2, _hourly_pay), (2, _change_back), (2, _pages_left), (2, _ages),
    (2, _share_then_buy), (3, _bake_and_bag), (2, _savings_weeks), (2, _rows_of_plants),
    (1, _buys_more), (1, _gives_away), (1, _boxes_in_all), (1, _equal_shares),
    (1, _one_day_pay), (1, _age_later)]


def _rows(problems: list[tuple[_Problem, int]], split: str,
          instruction: str) -> dict[str, list]:
    cols: dict[str, list] = {name: [] for name in _SCHEMA.names}
    for index, (p, answer) in enumerate(problems):
        cols["data_source"].append("openai/gsm8k")
        cols["prompt"].append([{"role": "user", "content": p.question + instruction}])
        cols["ability"].append("math")
        cols["reward_model"].append({"style": "rule", "ground_truth": str(answer)})
        cols["extra_info"].append({"split": split, "index": index,
                                   "answer": p.solution(answer), "question": p.question})
    return cols


def make_gsm8k_synth(out_dir: str | Path, *, seed: int = 0, n_train: int = 4096,
                     n_test: int = 256, max_number: int = 12, steps: str = "2,3",
                     instruction: str = INSTRUCTION,
                     row_group_size: int = 256) -> dict[str, Path]:
    """Write `train.parquet` (n_train rows) and `test.parquet` (n_test rows, no question shared
    with train) of seeded word problems; `max_number` bounds the numbers a template draws and
    `steps` lists the numbers of arithmetic steps a problem may take ("2,3": GSM8K's kind, the
    default; "1": one-step problems for very small models; "1,2,3": all). `instruction` is
    appended to every question (verl's by default)."""
    for key, value, low in (("seed", seed, 0), ("n_train", n_train, 1), ("n_test", n_test, 0),
                            ("max_number", max_number, 3), ("row_group_size", row_group_size, 1)):
        check_int(key, value, low)
    levels = {n for n, _ in TEMPLATES}
    try:
        wanted = {int(part) for part in str(steps).split(",")}
    except ValueError:
        wanted = set()
    if not wanted or not wanted <= levels:
        raise ValueError(f"gsm8k-synth: steps={steps!r} must list step counts from "
                         f"{sorted(levels)} separated by commas, e.g. '2,3' or '1'")
    templates = [make for n, make in TEMPLATES if n in wanted]
    r = random.Random(seed)
    seen: set[str] = set()
    problems: list[tuple[_Problem, int]] = []
    attempts = 0
    while len(problems) < n_train + n_test:
        attempts += 1
        if attempts > 50 * (n_train + n_test):
            raise ValueError(f"gsm8k-synth: only {len(problems)} distinct problems for "
                             f"n_train + n_test = {n_train + n_test}; raise max_number")
        problem, answer = r.choice(templates)(r, max_number)
        if problem.question not in seen:
            seen.add(problem.question)
            problems.append((problem, answer))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in (("train", problems[n_test:]), ("test", problems[:n_test])):
        table = pa.Table.from_pydict(_rows(rows, split, instruction), schema=_SCHEMA)
        paths[split] = write_parquet_atomic(table, out / f"{split}.parquet",
                                            row_group_size=row_group_size)
    return paths


# `gsm8k-synth-1step`: the one-step level with the short instruction — the level a
# ~100M-parameter model learns from with GRPO in 100 CPU steps (docs/performance.md:
# SmolLM2-135M answers ~20% of these greedily before training, ~2% of the default level).
make_gsm8k_synth_1step = partial(make_gsm8k_synth, steps="1", instruction=SHORT_INSTRUCTION)
