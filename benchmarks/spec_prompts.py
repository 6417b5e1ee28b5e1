"""The two workloads of `bench_spec.py` (not a script): copy-heavy prompts, whose answer
repeats a passage the prompt holds, and free generation.

The passages are original text written for this benchmark, 80 to 150 words each. Every
passage names a word that occurs in it more than once, and a replacement, for the prompts that
ask for a light edit, and a title.
"""

from __future__ import annotations

# (passage, word in it, replacement, title)
PASSAGES: list[tuple[str, str, str, str]] = [
    (
        "The lighthouse on Gull Point was built from grey granite hauled up the cliff by a team "
        "of six horses. For ninety years a keeper climbed its one hundred and twelve steps every "
        "evening to light the lamp, trim the wick and wind the clockwork that turned the great "
        "lens. The keeper kept a logbook of every ship that passed, every storm that broke on "
        "the rocks and every night the fog came in so thick that the beam vanished a few yards "
        "from the glass. When the lamp was finally automated, the last keeper carried the "
        "logbook down the steps, locked the door behind him and walked home along the beach "
        "without looking back.",
        "keeper",
        "warden",
        "The Last Keeper",
    ),
    (
        "To bake a simple country loaf, mix five hundred grams of flour with three hundred and "
        "fifty grams of warm water and leave the dough to rest for half an hour. Add ten grams "
        "of salt and a spoonful of starter, then fold the dough over itself every thirty minutes "
        "for two hours. Shape the dough into a tight round, dust it with flour and let it rise "
        "in a basket overnight in the fridge. In the morning, heat a heavy pot in the oven for "
        "forty minutes, drop the dough in, cover it and bake for twenty minutes. Remove the lid "
        "and bake for another twenty minutes, until the crust is dark and the loaf sounds "
        "hollow when tapped.",
        "dough",
        "paste",
        "Country Bread",
    ),
    (
        "Notice to residents: the town council will meet on Thursday evening at seven o'clock "
        "in the library hall to discuss the new parking rules for the market square. Residents "
        "who wish to speak must add their names to the list at the front desk before the "
        "meeting begins. Each speaker will have three minutes. The council will also vote on "
        "the budget for repairing the footbridge over the canal, which has been closed since "
        "the spring floods. Tea and biscuits will be served after the meeting. Residents who "
        "cannot attend may send written comments to the council office by Wednesday noon.",
        "council",
        "committee",
        "Council Meeting",
    ),
    (
        "The river begins as a trickle of melted snow high in the northern hills. It gathers "
        "strength as small streams join it, cutting a narrow valley through the pine forest and "
        "tumbling over a series of rocky falls. Below the falls the river slows and widens, "
        "winding through meadows where farmers graze cattle along its banks. Near the old mill "
        "town the river is crossed by three stone bridges, each built in a different century. "
        "From there it flows south across the plain, brown and slow, until it splits into a "
        "dozen channels in the marshes and finally spills into the sea.",
        "river",
        "stream",
        "The River",
    ),
    (
        "The Trailhead 30 backpack is made for long days on the mountain. Its main compartment "
        "holds thirty litres and opens fully with a curved zip, so you can reach the bottom of "
        "the pack without unloading it. A padded sleeve fits a water bladder or a small laptop. "
        "The hip belt carries two zipped pockets for snacks and a phone, and the shoulder straps "
        "are cut with breathable mesh to keep your back cool on steep climbs. The pack weighs "
        "just under one kilogram, comes with a rain cover tucked into the base and is available "
        "in green, grey and orange.",
        "pack",
        "bag",
        "Trailhead 30",
    ),
    (
        "Dear neighbour, I am writing to ask whether you have seen our cat, Biscuit, who has not "
        "come home since Sunday night. Biscuit is a small ginger cat with a white chest and one "
        "torn ear, and she wears a blue collar with a little bell. She is friendly but shy with "
        "strangers, so she may be hiding in a shed or a garage. If you could take a quick look "
        "in your outbuildings we would be very grateful. Please call us at any hour if you spot "
        "her. Our children are very worried, and we would happily bring you a cake to say "
        "thank you. With best wishes, the family at number twelve.",
        "cat",
        "kitten",
        "Lost Cat",
    ),
    (
        "The Alder Bridge was the first iron bridge in the valley. Before it was built, carts "
        "crossed the river on a ferry that could carry only one wagon at a time, and in winter "
        "the ferry often stopped for weeks. The bridge was cast in pieces at a foundry forty "
        "miles away and brought to the site on barges. Local workers bolted the arches together "
        "over one dry summer, and the bridge opened on the first day of autumn with a brass band "
        "and a parade of farm wagons. It carried traffic for a hundred and fifty years before "
        "it was closed to cars and kept as a footpath.",
        "bridge",
        "crossing",
        "The Alder Bridge",
    ),
    (
        "In the game of Harbour, each player controls a fleet of four boats and tries to deliver "
        "cargo to the ports around the edge of the board. On your turn you roll two dice and "
        "move one boat, or split the roll between two boats. When a boat enters a port it may "
        "load or unload one crate. Storm cards are drawn whenever a player rolls a double, and "
        "they can push boats off course or sink a crate. The first player to deliver six crates "
        "to six different ports wins the game. If the deck of storm cards runs out, the player "
        "with the most deliveries wins instead.",
        "boat",
        "ship",
        "How to Play Harbour",
    ),
]

COPY_TEMPLATES: list[str] = [
    "Copy this text exactly, word for word:\n\n{passage}",
    'Repeat the following paragraph, changing only the word "{old}" to "{new}":\n\n{passage}',
    "Here is a paragraph:\n\n{passage}\n\nWrite the paragraph out again, unchanged.",
    'Repeat the following text, adding the title "{title}" on its own line first:\n\n{passage}',
]

STORY_TOPICS: list[str] = [
    "a clockmaker who builds a clock that runs backwards",
    "a lost dog finding its way home across a city",
    "two friends who open a bakery on the moon",
    "a girl who can talk to the wind",
    "a robot learning to paint",
    "a village where it never stops snowing",
    "a sailor who finds a map inside a bottle",
    "a librarian who discovers a book that writes itself",
    "a fox and a crow who become business partners",
    "the last tree in a desert town",
    "a boy who collects sounds in jars",
    "an old train that decides to retire",
    "a gardener whose vegetables grow overnight",
    "a detective who solves crimes by smell",
    "a dragon that is afraid of the dark",
    "a musician who plays for the stars",
]

EXPLAIN_TOPICS: list[str] = [
    "a refrigerator keeps food cold",
    "vaccines train the immune system",
    "a bicycle stays upright while moving",
    "the internet sends data between computers",
    "rainbows form in the sky",
    "an electric motor turns electricity into motion",
    "bees make honey",
    "a credit card payment is processed",
    "tides are caused by the moon",
    "a compass finds north",
    "plants turn sunlight into food",
    "a microwave oven heats food",
    "airplanes stay in the air",
    "a search engine ranks web pages",
    "the heart pumps blood around the body",
    "solar panels produce electricity",
]

# a prompt unlike both workloads, for each process's warm-up request
WARMUP = "Say hello in one short sentence."


def copy_prompts(n: int) -> list[str]:
    """`n` copy-heavy prompts; the first 32 are all distinct (8 passages x 4 templates, in an
    order where neighbours differ in both)."""
    out = []
    for i in range(n):
        passage, old, new, title = PASSAGES[i % len(PASSAGES)]
        template = COPY_TEMPLATES[(i // len(PASSAGES) + i) % len(COPY_TEMPLATES)]
        out.append(template.format(passage=passage, old=old, new=new, title=title))
    return out


def free_prompts(n: int) -> list[str]:
    """`n` open-ended prompts, alternating stories and explanations; the first 32 distinct."""
    out = []
    for i in range(n):
        j = (i // 2) % len(STORY_TOPICS)
        if i % 2 == 0:
            out.append(f"Write a short story about {STORY_TOPICS[j]}.")
        else:
            out.append(f"Explain how {EXPLAIN_TOPICS[j]}.")
    return out


WORKLOADS = {"copy": copy_prompts, "free": free_prompts}
