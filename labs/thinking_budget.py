"""Lab: what thinking tokens buy, and what they cost, under a budget.

No catalogue model is trained to think, so this lab makes one think the way Qwen3's chat
template does: the answer opens with <think>, the model writes until it closes the
marker itself, and with a budget of N the engine forces the closing marker after N tokens
(engine/thinking.py); the answer follows. What thinking buys is therefore measured on a
model that was never taught to use it, and stated as such. The questions are arithmetic
word problems with one integer answer (made from a seed), so an answer is checked by the
last integer it holds. For each budget the whole set runs as one offline batch, greedy:

- thinking tokens per question (the markers included), and answer tokens;
- answered: replies with an answer after the thinking at all;
- accuracy: answers whose last integer is the right one (and the same over the thinking
  and the answer together, since a model never taught to think may do all its working,
  and stop, inside it);
- seconds for the set, and tokens a second.

    python labs/thinking_budget.py [--model qwen2.5-coder-0.5b] [--budgets 0,32,128,512]

Writes an evidence record and a PNG (accuracy and seconds against the budget).
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from tokenworks import LLM, SamplingParams  # noqa: E402
from tokenworks.bench.labs import parse_lab_args, save_figure  # noqa: E402
from tokenworks.bench.record import make_record, model_record, write_record  # noqa: E402
from tokenworks.engine.request import Thinking  # noqa: E402
from tokenworks.tokenizer.chat import ChatTemplate  # noqa: E402

# Qwen3's way of opening the thinking at the start of every answer, in ChatML
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
ASK = "Work it out step by step if you need to, then give the final number."


def questions(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """n word problems with one integer answer each."""
    rng = random.Random(seed)
    out = []
    forms = [
        (
            lambda a, b, c: (
                f"A shop has {a} apples, sells {b}, then receives {c} more. "
                "How many apples does it have now?"
            ),
            lambda a, b, c: a - b + c,
        ),
        (
            lambda a, b, c: (
                f"Each box holds {b} pens. How many pens are there in {c} boxes and {a} loose pens?"
            ),
            lambda a, b, c: b * c + a,
        ),
        (
            lambda a, b, c: (
                f"A train travels {b * c} km in {b} hours. What is its speed in km "
                f"an hour, plus {a}?"
            ),
            lambda a, b, c: c + a,
        ),
    ]
    for _ in range(n):
        a, b, c = rng.randint(12, 90), rng.randint(2, 11), rng.randint(3, 40)
        ask, answer = forms[rng.randrange(len(forms))]
        out.append((f"{ask(a, b, c)} {ASK}", answer(a, b, c)))
    return out  # fmt: skip


def last_integer(text: str) -> int | None:
    found = re.findall(r"-?\d+", text.replace(",", ""))
    return int(found[-1]) if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--budgets", default="0,32,128,512", help="thinking tokens at most")
    ap.add_argument("--questions", type=int, default=24)
    ap.add_argument("--answer-tokens", type=int, default=160, help="tokens after the thinking")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results")
    args = parse_lab_args(
        ap, fast=dict(model="smollm2-135m", budgets="0,8", questions=2, answer_tokens=16)
    )
    budgets = [int(b) for b in args.budgets.split(",")]

    llm = LLM(args.model, threads=args.threads, max_num_seqs=args.questions, warmup=False)
    tok = llm.tokenizer
    template = ChatTemplate(TEMPLATE, tok)
    qs = questions(args.questions)
    prompts = [template.render([{"role": "user", "content": q}]) for q, _ in qs]
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    rows = {}
    for budget in budgets:
        thinking = Thinking(end_ids=end, opened=True, budget=budget)
        params = SamplingParams(max_tokens=budget + len(end) + args.answer_tokens,
                                temperature=0, thinking=thinking)  # fmt: skip
        t = time.perf_counter()
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        seconds = time.perf_counter() - t
        answers = [tok.decode(o.token_ids[o.reasoning_tokens :]) for o in outs]
        right = [last_integer(a) == want for a, (_, want) in zip(answers, qs, strict=True)]
        # the same judge over thinking and answer together: a model never taught to think
        # may do its working, and end, inside the thinking
        whole = [tok.decode(o.token_ids) for o in outs]
        anywhere = [last_integer(w) == want for w, (_, want) in zip(whole, qs, strict=True)]
        tokens = sum(len(o.token_ids) for o in outs)
        rows[f"budget_{budget}"] = {
            "budget": budget,
            "accuracy": sum(right) / len(qs),
            "accuracy_thinking_included": sum(anywhere) / len(qs),
            "answered": sum(bool(a.strip()) for a in answers) / len(qs),
            "thinking_tokens": statistics.mean(o.reasoning_tokens for o in outs),
            "answer_tokens": statistics.mean(len(o.token_ids) - o.reasoning_tokens for o in outs),
            "seconds": seconds,
            "tok_s": tokens / seconds,
            "answers": answers,
            "right": right,
        }
        r = rows[f"budget_{budget}"]
        print(f"budget {budget:4d}: {r['thinking_tokens']:6.1f} thinking tokens, "
              f"{r['answered']:.0%} answered, accuracy {r['accuracy']:.0%} (thinking "
              f"included {r['accuracy_thinking_included']:.0%}), {seconds:.1f} s for "
              f"{len(qs)} questions")  # fmt: skip
    record = make_record(
        kind="lab.thinking_budget",
        engine=llm.config.to_dict(),
        model=model_record(llm),
        workload={
            "template": TEMPLATE,
            "questions": qs,
            "budgets": budgets,
            "answer_tokens": args.answer_tokens,
            "greedy": True,
        },
        results={"rows": rows},
        seeds=[0],
    )
    path = write_record(record, args.out)

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    xs = [str(x) for x in budgets]
    w = [i - 0.2 for i in range(len(xs))], [i + 0.2 for i in range(len(xs))]
    a.bar(w[0], [100 * rows[f"budget_{x}"]["accuracy"] for x in budgets], 0.4,
          color="#4477aa", label="the answer")  # fmt: skip
    a.bar(w[1], [100 * rows[f"budget_{x}"]["accuracy_thinking_included"] for x in budgets], 0.4,
          color="#88ccee", label="thinking and answer")  # fmt: skip
    a.set_xticks(range(len(xs)), xs)
    a.legend(fontsize=8)
    a.set(xlabel="thinking budget (tokens)", ylabel="% right", ylim=(0, 100),
          title=f"{args.model}: {len(qs)} word problems")  # fmt: skip
    b.bar(xs, [rows[f"budget_{x}"]["seconds"] for x in budgets], color="#cc6677")
    b.set(xlabel="thinking budget (tokens)", ylabel="seconds for the set (one batch)")
    fig.tight_layout()
    save_figure(fig, args.out, path.with_suffix(".png").name)
    print(f"record: {path}")


if __name__ == "__main__":
    main()
