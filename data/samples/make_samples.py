"""Write the bundled sample datasets (deterministic; written for this project, not copied).

    python data/samples/make_samples.py            # rewrites the two files next to this script

- ``glaive_like.jsonl``: 300 rows, ``messages`` shape (system + user), function-calling assistant
  prompts: a system turn lists one to three JSON function schemas, the user asks for something.
- ``opencode_like.jsonl``: 300 rows, ShareGPT ``conversations`` shape (``from``/``value``), coding
  questions; about a third carry a system turn, a few are two-turn with an earlier answer.

Every row has an ``id``; all rows are valid (bad-row fixtures live in the tests). Prompts are about
30 to 300 tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = 300

FUNCTIONS = [
    ("get_weather", "Get the current weather for a city", {"city": "string", "unit": "string"}),
    ("convert_currency", "Convert an amount between two currencies", {"amount": "number", "from": "string", "to": "string"}),
    ("search_flights", "Search flights between two airports on a date", {"origin": "string", "destination": "string", "date": "string"}),
    ("create_calendar_event", "Create a calendar event", {"title": "string", "start": "string", "duration_min": "integer"}),
    ("calculate_loan_payment", "Monthly payment of a fixed-rate loan", {"principal": "number", "annual_rate": "number", "years": "integer"}),
    ("get_stock_price", "Latest price of a stock ticker", {"ticker": "string"}),
    ("translate_text", "Translate text into a target language", {"text": "string", "target_language": "string"}),
    ("find_restaurants", "Find restaurants near a location", {"location": "string", "cuisine": "string", "max_results": "integer"}),
    ("send_email", "Send an email", {"to": "string", "subject": "string", "body": "string"}),
    ("get_directions", "Driving directions between two places", {"origin": "string", "destination": "string"}),
    ("book_hotel", "Book a hotel room", {"city": "string", "check_in": "string", "nights": "integer"}),
    ("calculate_bmi", "Body mass index from height and weight", {"height_cm": "number", "weight_kg": "number"}),
]
CITIES = ["Oslo", "Lisbon", "Nairobi", "Osaka", "Montreal", "Valparaíso", "Tbilisi", "Hanoi", "Kraków", "Austin"]
CURRENCIES = ["EUR", "USD", "JPY", "GBP", "NOK", "BRL", "INR"]
LANGS = ["French", "German", "Japanese", "Swahili", "Portuguese", "Korean"]
CUISINES = ["Thai", "Ethiopian", "vegetarian", "seafood", "Georgian", "ramen"]
ASKS = {
    "get_weather": "What's the weather like in {city} right now? Please give it in {unit}.",
    "convert_currency": "How much is {amount} {cur1} in {cur2} today?",
    "search_flights": "Can you find me a flight from {city} to {city2} on {date}?",
    "create_calendar_event": "Put a meeting called '{title}' on my calendar for {date} at 10:00, {mins} minutes long.",
    "calculate_loan_payment": "I want to borrow {principal} at {rate}% for {years} years. What would my monthly payment be?",
    "get_stock_price": "What is {ticker} trading at?",
    "translate_text": "Translate this into {lang}: \"{sentence}\"",
    "find_restaurants": "Any good {cuisine} places near {city}? Just the top {n}.",
    "send_email": "Email {person} with the subject '{title}' and tell them {sentence}",
    "get_directions": "How do I drive from {city} to {city2}?",
    "book_hotel": "Book me a hotel in {city} from {date} for {n} nights.",
    "calculate_bmi": "I'm {height} cm tall and weigh {weight} kg. What's my BMI?",
}
SENTENCES = [
    "the quarterly report is ready for review",
    "we will be twenty minutes late to the workshop",
    "the new build fixes the crash on startup",
    "thank you for hosting us last weekend",
    "the venue changed to the second floor",
]
EXTRAS = [
    "",
    " Also, keep the answer short.",
    " If you need more details from me, ask first.",
    " I'm planning a trip next month, so this matters quite a bit.",
    " Explain what you are doing before calling anything.",
]

TOPICS = [
    ("Python", "a function that returns the n-th Fibonacci number iteratively"),
    ("Python", "a context manager that times a block of code"),
    ("Rust", "a function that reverses the words in a string"),
    ("Go", "a worker pool that processes jobs from a channel"),
    ("TypeScript", "a debounce helper with proper typing"),
    ("SQL", "a query returning each customer's three most recent orders"),
    ("C", "a ring buffer with push and pop"),
    ("Bash", "a script that deletes log files older than seven days"),
    ("Python", "an LRU cache without functools"),
    ("Java", "a thread-safe singleton"),
    ("Rust", "an iterator over the prime numbers"),
    ("Python", "a parser for key=value config files with comments"),
]
QUESTION_FORMS = [
    "Write {what} in {lang}.",
    "How would you implement {what} in {lang}? Show the code and explain the complexity.",
    "I need {what} in {lang}. Please include a couple of tests.",
    "Can you review my approach? I want {what} in {lang}, and I am worried about edge cases.",
]
BUGGY = [
    ("Python", "def mean(xs):\n    return sum(xs) / len(xs)\n", "it crashes on an empty list"),
    ("JavaScript", "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 0);\n}\n", "it prints 3 three times"),
    ("Python", "def add_item(item, items=[]):\n    items.append(item)\n    return items\n", "the list keeps growing between calls"),
    ("Go", "for _, v := range values {\n    go func() { fmt.Println(v) }()\n}\n", "the output is sometimes wrong on old Go versions"),
    ("C", "char *copy(const char *s) {\n    char buf[64];\n    strcpy(buf, s);\n    return buf;\n}\n", "it returns garbage"),
]
CONTEXTS = [
    "I'm building a small command-line tool for my team and want the code to be easy to maintain.",
    "This is for a coding interview practice session, so clarity matters more than cleverness.",
    "We run this inside a service that handles a few thousand requests per second.",
    "I'm new to the language and would like to understand the idioms, not just copy an answer.",
    "The code will run on a resource-constrained embedded Linux box with little memory.",
]
SYSTEMS = [
    "You are a senior software engineer. Answer with working code first, then a short explanation.",
    "You are a patient programming tutor. Explain your reasoning step by step.",
    "You are a code reviewer. Be precise and point out bugs, then show a fix.",
]


def _schema(name: str, desc: str, params: dict[str, str]) -> dict[str, object]:
    return {
        "name": name,
        "description": desc,
        "parameters": {
            "type": "object",
            "properties": {k: {"type": v} for k, v in params.items()},
            "required": list(params)[:2],
        },
    }


def glaive_like(rng: random.Random) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i in range(ROWS):
        chosen = rng.sample(FUNCTIONS, k=rng.randint(1, 3))
        schemas = "\n".join(json.dumps(_schema(*f), ensure_ascii=False) for f in chosen)
        system = (
            "You are a helpful assistant with access to the following functions. "
            "Use them if required, replying with a JSON object "
            '{"name": <function>, "arguments": {...}} inside <tool_call></tool_call> tags.\n' + schemas
        )
        target = chosen[0][0] if rng.random() < 0.85 else rng.choice(FUNCTIONS)[0]
        city, city2 = rng.sample(CITIES, 2)
        cur1, cur2 = rng.sample(CURRENCIES, 2)
        ask = ASKS[target].format(
            city=city, city2=city2, unit=rng.choice(["celsius", "fahrenheit"]), amount=rng.randint(5, 5000),
            cur1=cur1, cur2=cur2, date=f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            title=rng.choice(["Design sync", "Budget review", "1:1", "Launch retro"]), mins=rng.choice([15, 30, 45, 60]),
            principal=rng.randint(10, 900) * 1000, rate=rng.choice([3.5, 4.25, 5.1, 6.0]), years=rng.choice([10, 15, 20, 30]),
            ticker=rng.choice(["NVDA", "AAPL", "SAP", "TSM", "ASML"]), lang=rng.choice(LANGS),
            sentence=rng.choice(SENTENCES), cuisine=rng.choice(CUISINES), n=rng.randint(2, 6),
            person=rng.choice(["Amara", "Jonas", "Mei", "Carlos"]), height=rng.randint(150, 200), weight=rng.randint(45, 120),
        )
        rows.append(
            {
                "id": f"glaive-{i:05d}",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": ask + rng.choice(EXTRAS)},
                ],
            }
        )
    return rows


def opencode_like(rng: random.Random) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for i in range(ROWS):
        turns: list[dict[str, str]] = []
        if rng.random() < 0.33:
            turns.append({"from": "system", "value": rng.choice(SYSTEMS)})
        if rng.random() < 0.4:
            lang, code, symptom = rng.choice(BUGGY)
            question = f"This {lang} code has a bug: {symptom}.\n\n```\n{code}```\nWhat is wrong and how do I fix it?"
        else:
            lang, what = rng.choice(TOPICS)
            question = rng.choice(QUESTION_FORMS).format(what=what, lang=lang)
        if rng.random() < 0.1:
            lang2, what2 = rng.choice(TOPICS)
            turns.append({"from": "human", "value": f"Quick one first: what does {what2} mean in {lang2}?"})
            turns.append({"from": "gpt", "value": f"It is a small exercise: you write {what2} in idiomatic {lang2}."})
        turns.append({"from": "human", "value": f"{rng.choice(CONTEXTS)} {question}"})
        rows.append({"id": f"opencode-{i:05d}", "conversations": turns})
    return rows


def write(path: Path, rows: list[dict[str, object]]) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def main() -> None:
    write(HERE / "glaive_like.jsonl", glaive_like(random.Random(20260101)))
    write(HERE / "opencode_like.jsonl", opencode_like(random.Random(20260102)))


if __name__ == "__main__":
    main()
