"""Fixed chat prompts of the speculative-decoding workloads (`pagedllm bench spec`): tasks
whose answers repeat their input, the case speculation without a draft model is for.

Each family has 8 conversations (the 8 concurrent streams; the single-stream runs take the
first ones). They are plain data: the bench renders them with the model's chat template.
"""
from __future__ import annotations

Message = dict[str, str]

# ---- code editing: rewrite a 40-80-line function with one change --------------------------

_SUMMARIZE = '''def summarize(records, key, threshold=0.0, weights=None):
    """Group records by key and report count, total, mean and the largest value."""
    if not key:
        raise ValueError("key must be a non-empty string")
    if weights is not None and not isinstance(weights, dict):
        raise TypeError("weights must be a dict or None")
    groups = {}
    for record in records:
        name = record.get(key)
        if name is None:
            continue
        value = float(record.get("value", 0.0))
        if value < threshold:
            continue
        weight = 1.0 if weights is None else weights.get(name, 1.0)
        group = groups.setdefault(name, {"count": 0, "total": 0.0, "largest": None})
        group["count"] += 1
        group["total"] += value * weight
        if group["largest"] is None or value > group["largest"]:
            group["largest"] = value
    report = []
    for name, group in sorted(groups.items()):
        count = group["count"]
        total = group["total"]
        mean = total / count if count else 0.0
        report.append({
            "name": name,
            "count": count,
            "total": round(total, 3),
            "mean": round(mean, 3),
            "largest": group["largest"],
        })
    report.sort(key=lambda row: row["total"], reverse=True)
    if not report:
        return []
    best = report[0]["total"]
    for row in report:
        if best:
            row["share"] = round(row["total"] / best, 3)
        else:
            row["share"] = 0.0
    for rank, row in enumerate(report, start=1):
        row["rank"] = rank
    return report
'''

_PARSE_LOG = '''def parse_log(lines, levels=None, since=None, max_message=200):
    """Parse "2024-05-01 12:00:03 WARN [db] message" lines into entries and counts."""
    if max_message < 1:
        raise ValueError("max_message must be at least 1")
    if levels is not None:
        levels = set(levels)
    entries = []
    counts = {}
    skipped = 0
    for number, line in enumerate(lines, start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(" ", 4)
        if len(parts) < 5:
            skipped += 1
            continue
        date, time, level, source, message = parts
        if levels is not None and level not in levels:
            continue
        stamp = date + " " + time
        if since is not None and stamp < since:
            continue
        if not (source.startswith("[") and source.endswith("]")):
            skipped += 1
            continue
        source = source[1:-1]
        if len(message) > max_message:
            message = message[:max_message] + "..."
        entries.append({
            "line": number,
            "stamp": stamp,
            "level": level,
            "source": source,
            "message": message,
        })
        key = (level, source)
        counts[key] = counts.get(key, 0) + 1
    if not entries:
        return {"entries": [], "summary": [], "skipped": skipped}
    summary = []
    for (level, source), count in sorted(counts.items()):
        summary.append(f"{level:<5} {source:<12} {count}")
    return {"entries": entries, "summary": summary, "skipped": skipped}
'''

_CODE_CHANGES = [
    (_SUMMARIZE, "rename the parameter `records` to `rows` everywhere"),
    (_PARSE_LOG, "rename the variable `entries` to `parsed` everywhere"),
    (_SUMMARIZE, "change the default of `threshold` from 0.0 to 1.0"),
    (_PARSE_LOG, "change the default of `max_message` from 200 to 120"),
    (_SUMMARIZE, "round to 2 decimal places instead of 3"),
    (_PARSE_LOG, "skip lines that start with \"//\" as well as \"#\""),
    (_SUMMARIZE, "rename the local variable `group` to `bucket` everywhere"),
    (_PARSE_LOG, "rename the parameter `lines` to `log_lines` everywhere"),
]


def code_edit() -> list[list[Message]]:
    return [[{"role": "user", "content": (
        f"Rewrite this Python function with one change: {change}. Answer with the whole "
        f"rewritten function only, in a code block.\n\n```python\n{code}```")}]
        for code, change in _CODE_CHANGES]


# ---- summarization and extraction from a passage ------------------------------------------

_HARBOR = (
    "The town council of Port Elwin met on 14 March 2023 to decide the future of the old "
    "harbor. Mayor Helen Achterberg opened the session by reminding members that the north "
    "pier had been closed since the storm of November 2021, when waves of more than six "
    "meters tore away forty meters of decking. Engineers from Dunmore & Lake estimated that "
    "repairing the pier would cost 4.2 million euros and take eighteen months, while "
    "demolishing it and building a floating breakwater would cost 3.1 million euros and "
    "take a year. The fishing cooperative, represented by its chair Tomas Rieke, argued for "
    "the repair: twenty-six boats still land their catch at Port Elwin, and the cooperative "
    "said that a floating breakwater would not protect the inner basin in winter. The "
    "tourism office, led by Ines Valdera, preferred the breakwater, which would leave room "
    "for a marina of eighty berths that could open in the summer of 2025. Councillor Peter "
    "Smolenski asked whether the regional government would share the cost; the finance "
    "officer, Marta Kowalczyk, answered that the region had offered 1.5 million euros for "
    "either option, provided that work started before the end of 2023. After three hours "
    "of debate the council voted nine to four to repair the north pier, and asked the "
    "tourism office to propose a smaller marina in the south basin by 30 June 2023. Work "
    "on the pier began on 2 October 2023 and the contractor, Brennan Marine, expects to "
    "finish in April 2025.")

_ENZYME = (
    "Researchers at the University of Tallinn reported in May 2022 that an enzyme found in "
    "compost bacteria can break down polyethylene terephthalate, the plastic used in most "
    "drink bottles, at temperatures as low as 40 degrees Celsius. The team, led by Dr. Kaia "
    "Mets, isolated the enzyme, which they named TL-7, from a compost heap at a farm near "
    "Tartu. In laboratory tests TL-7 broke down 82 percent of a shredded bottle in 48 hours, "
    "compared with 31 percent for the best enzyme previously described. The researchers "
    "then changed three amino acids of the enzyme; the variant, TL-7b, broke down 91 percent "
    "of the plastic in the same time and stayed active for five days instead of two. Dr. "
    "Mets cautioned that the tests used clean, shredded plastic, and that colored or mixed "
    "plastics from household waste were broken down far more slowly. A recycling company, "
    "Baltic Polymer, has agreed to test TL-7b in a pilot plant in Parnu that will process "
    "two tonnes of bottles a week, starting in January 2023. The work was funded by the "
    "Estonian Research Council and by a grant of 600,000 euros from the European Union. "
    "Professor Lars Heino of the University of Turku, who was not involved in the study, "
    "said that the low working temperature was the most important result, because heating "
    "plastic to 70 degrees, as earlier enzymes required, uses much of the energy that "
    "recycling is meant to save.")

_PASSAGE_TASKS = [
    (_HARBOR, "Summarize this passage in four sentences."),
    (_ENZYME, "Summarize this passage in four sentences."),
    (_HARBOR, "List every person named in the passage with their role, one per line, "
              "as \"Name - role\"."),
    (_ENZYME, "List every number in the passage with what it measures, one per line."),
    (_HARBOR, "Extract every date in the passage and what happened on it, as a JSON list "
              "of objects with the keys \"date\" and \"event\"."),
    (_ENZYME, "Quote the three sentences of the passage that describe test results, word "
              "for word."),
    (_HARBOR, "Quote the sentences of the passage that mention money, word for word."),
    (_ENZYME, "Extract the people and organizations named in the passage as a JSON object "
              "with the keys \"people\" and \"organizations\"."),
]


def summarize_extract() -> list[list[Message]]:
    return [[{"role": "user", "content": f"{task}\n\nPassage:\n{passage}"}]
            for passage, task in _PASSAGE_TASKS]


# ---- multi-turn chat that quotes earlier turns ---------------------------------------------

_TRIP = [
    {"role": "user", "content": "I am planning a three-day walking trip in the Lake District. "
                                "Give me a packing list of ten items, numbered."},
    {"role": "assistant", "content": (
        "Here is a packing list for a three-day walking trip in the Lake District:\n\n"
        "1. Waterproof jacket with a hood\n2. Waterproof trousers\n"
        "3. Broken-in walking boots with ankle support\n4. Two pairs of wool walking socks "
        "per day\n5. A warm fleece or insulated layer\n6. A 30-liter rucksack with a rain "
        "cover\n7. Ordnance Survey map OL7 and a compass\n8. A head torch with spare "
        "batteries\n9. A first-aid kit with blister plasters\n10. A refillable water bottle "
        "and high-energy snacks\n\nThe weather in the fells changes quickly, so keep the "
        "waterproofs at the top of your rucksack.")},
]
_SOUP = [
    {"role": "user", "content": "Write a simple recipe for tomato soup for four people, with "
                                "an ingredient list and numbered steps."},
    {"role": "assistant", "content": (
        "Tomato soup (serves 4)\n\nIngredients:\n- 1 kg ripe tomatoes, chopped\n- 1 onion, "
        "diced\n- 2 cloves of garlic, sliced\n- 2 tablespoons olive oil\n- 500 ml vegetable "
        "stock\n- 1 teaspoon sugar\n- Salt and pepper\n- A handful of fresh basil\n\nSteps:\n"
        "1. Heat the olive oil in a large pot over medium heat.\n2. Add the onion and cook "
        "for five minutes until soft.\n3. Add the garlic and cook for one more minute.\n"
        "4. Add the tomatoes, stock and sugar, and bring to a boil.\n5. Lower the heat and "
        "simmer for twenty minutes.\n6. Blend until smooth, then season with salt and "
        "pepper.\n7. Serve hot with torn basil leaves on top.")},
]
_FOLLOW_UPS = [
    (_TRIP, "Repeat the list exactly, but add a short reason after each item."),
    (_SOUP, "Repeat the steps exactly, but double every quantity they mention."),
    (_TRIP, "Copy items 1 to 6 of your list word for word, then suggest two more items."),
    (_SOUP, "Write out the ingredient list again, word for word, with a vegan alternative "
            "where one is needed."),
    (_TRIP, "Put your list in alphabetical order, keeping each item's words unchanged."),
    (_SOUP, "Repeat the recipe word for word, then add a step for making croutons."),
    (_TRIP, "Repeat your list, then quote your last sentence and explain it."),
    (_SOUP, "Quote steps 4 to 7 exactly as you wrote them, then say which step takes "
            "longest."),
]


def multi_turn() -> list[list[Message]]:
    return [[*history, {"role": "user", "content": ask}] for history, ask in _FOLLOW_UPS]


# ---- agent loop: the same tool-call format again and again ---------------------------------

_AGENT_SYSTEM = (
    "You are an assistant that manages files through tools. To call a tool, answer with one "
    "line of the form\n<tool_call>{\"name\": TOOL, \"arguments\": {...}}</tool_call>\n"
    "Tools: list_dir {\"path\": string}; read_file {\"path\": string}; "
    "write_file {\"path\": string, \"content\": string}; "
    "move_file {\"source\": string, \"destination\": string}. "
    "After each tool call you get the tool's result. Call one tool at a time.")
_AGENT_HISTORY = [
    {"role": "system", "content": _AGENT_SYSTEM},
    {"role": "user", "content": "Archive the 2023 reports and tell me what is left."},
    {"role": "assistant", "content": "<tool_call>{\"name\": \"list_dir\", \"arguments\": "
                                     "{\"path\": \"reports\"}}</tool_call>"},
    {"role": "user", "content": "Tool result: reports/2023-q1.txt, reports/2023-q2.txt, "
                                "reports/2023-q3.txt, reports/2024-q1.txt, reports/notes.md"},
    {"role": "assistant", "content": "<tool_call>{\"name\": \"move_file\", \"arguments\": "
                                     "{\"source\": \"reports/2023-q1.txt\", \"destination\": "
                                     "\"archive/2023-q1.txt\"}}</tool_call>"},
    {"role": "user", "content": "Tool result: moved reports/2023-q1.txt to archive/2023-q1.txt"},
    {"role": "assistant", "content": "<tool_call>{\"name\": \"move_file\", \"arguments\": "
                                     "{\"source\": \"reports/2023-q2.txt\", \"destination\": "
                                     "\"archive/2023-q2.txt\"}}</tool_call>"},
    {"role": "user", "content": "Tool result: moved reports/2023-q2.txt to archive/2023-q2.txt"},
]
_AGENT_NEXT = [
    "Continue with the next tool call.",
    "Continue: move the remaining 2023 report the same way.",
    "Now write the calls that move reports/2024-q1.txt and reports/notes.md to archive/, "
    "one per line.",
    "Now read reports/notes.md.",
    "Write all the move_file calls you made so far again, one per line, for the log.",
    "Now list the archive directory.",
    "Write a file archive/index.md whose content lists the three archived reports.",
    "Move every file you moved to archive/ back to reports/, one tool call per line.",
]


def agent() -> list[list[Message]]:
    return [[*_AGENT_HISTORY, {"role": "user", "content": ask}] for ask in _AGENT_NEXT]


FAMILIES = {"code-edit": code_edit, "summarize-extract": summarize_extract,
            "multi-turn": multi_turn, "agent": agent}
