"""The built-in demo model: a tiny Llama trained to write English-like text, shipped in the package.

Owns where ``--model demo`` lives (``demo_weights/`` beside this module, written by
``scripts/train_demo_model.py``; see docs/demo_model.md) and what that recipe and the tests
share: the special tokens, the ChatML template, and the byte-level BPE tokenizer builder that
test fixtures also use to give random tiny models a real tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tokenmill.errors import ModelLoadError

DEMO_MODEL_DIR = Path(__file__).resolve().with_name("demo_weights")
DEMO_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Trained first, so their ids are 0..3 in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# ChatML; BOS comes from the template, so rendered chats are encoded without special tokens.
# With ``tools`` it writes Qwen2.5's (Hermes) tool prompt: signatures in <tools>, calls as
# <tool_call>{"name": ..., "arguments": ...}</tool_call>, results as <tool_response>; a
# conversation without tools renders exactly as plain ChatML.
CHATML_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (tools and loop.first and message['role'] == 'system') %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'tool' %}{{ '<tool_response>\\n' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'tool' %}{{ '\\n</tool_response>' }}{% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' }}{{ call['function']['name'] | tojson }}"
    "{{ ', \"arguments\": ' }}"
    "{% if call['function']['arguments'] is string %}{{ call['function']['arguments'] }}"
    "{% else %}{{ call['function']['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

DEFAULT_VOCAB_SIZE = 2048

# A small English corpus (original sentences) for the tokenizers of random test models, which
# need real merges but not the demo model's 2048-token vocabulary.
DEMO_CORPUS = """\
The quick brown fox jumps over the lazy dog while the farmer watches from the porch.
A tokenizer splits text into pieces, and a language model predicts the next piece.
Once upon a time, in a village by the sea, there lived an old fisherman and his daughter.
Every morning they walked down to the harbor before the sun rose above the hills.
The river ran quietly through the valley, past fields of wheat and rows of apple trees.
She opened the window, and the smell of rain filled the small wooden room.
Scientists measure the speed of light with great care; it is about 299,792 kilometers per second.
Water boils at 100 degrees Celsius at sea level, but at lower temperatures on high mountains.
The library was open from nine in the morning until six in the evening, except on Sundays.
He wrote a long letter to his brother, describing the city, the people, and the weather.
Good questions are often more useful than quick answers.
What time does the train leave for the capital? It leaves at half past seven.
How many stars can you see on a clear night far away from the city lights?
Please remember to bring your umbrella, because the forecast says it will rain all week.
The committee met on Tuesday to discuss the budget, the schedule, and the new building.
Music drifted from the open door of the cafe, where a few friends were playing cards.
In the winter the lake freezes, and children skate on the ice after school.
The engine hummed as the ship sailed north, carrying grain, wool, and timber to distant ports.
A good teacher explains an idea in several ways until every student understands it.
The garden was full of roses, tulips, daisies, and a single tall sunflower.
Numbers like 1, 2, 3, 10, 42, 100, 2024 and 3.14159 appear in many kinds of text.
They counted the coins: one, two, three, four, five, six, seven, eight, nine, ten.
Mathematics is the study of patterns, shapes, quantities, and the relations between them.
The doctor said that a short walk every day is good for the heart and the mind.
When the bell rang, the students gathered their books and hurried into the hall.
A map is not the territory, but a good map helps travelers find their way.
The baker rose early to prepare bread, rolls, and cakes for the market.
If you heat the metal slowly, it becomes soft enough to bend into a new shape.
The old castle stood on a hill, and its towers could be seen for many miles.
Birds sang in the trees as the first light of dawn spread across the sky.
"Where are you going?" asked the girl. "To the market," replied the boy, "to buy some eggs."
It's a beautiful day, isn't it? I'd like to go outside, but I've got work to do.
We'll meet at the station; don't be late, and you're welcome to bring a friend.
The function returns a list of numbers, sorted from the smallest to the largest.
def add(a, b):
    return a + b
for i in range(10):
    print(i * i)
if x > 0 and y < 5:
    result = {"name": "tokenmill", "version": 1, "fast": True}
The user asked a question, and the assistant answered politely and clearly.
User: Can you tell me a story about a dragon?
Assistant: Of course! Long ago, a gentle dragon guarded a mountain full of books.
User: What is the capital of France?
Assistant: The capital of France is Paris, a city known for art, food, and history.
User: Thank you for your help.
Assistant: You're welcome. Let me know if there is anything else I can do.
Summer brought long evenings, warm winds, and the sound of crickets in the grass.
The merchant weighed the spices carefully: pepper, cinnamon, ginger, and saffron.
A careful reader notices small details that others might miss.
The clock on the wall struck midnight, and the house fell silent.
Trains, buses, bicycles, and boats carried people across the busy city.
The experiment failed twice, but on the third attempt the results were clear.
Learning a new language takes patience, practice, and a little courage.
The mountain path was narrow and steep, with loose stones and sudden turns.
Her grandmother told stories about the war, the famine, and the long journey west.
The painter mixed blue and yellow to make a deep green for the forest.
On Monday it snowed; on Tuesday it rained; on Wednesday the sun finally returned.
Café, naïve, résumé, and façade are words borrowed from French.
Hello world! Bonjour le monde! Hola mundo! Ciao mondo!
The answer is simple: work hard, be kind, and keep learning.
Server logs showed 503 errors between 02:00 and 02:15, then traffic returned to normal.
Inference engines batch many requests together to keep the accelerator busy.
A cache stores recent results so that repeated work can be skipped.
Tokens are generated one at a time, each conditioned on all the tokens before it.
The sampler picks the next token using temperature, top-p, and top-k settings.
Streaming sends each new piece of text to the client as soon as it is ready.
System: You are a helpful assistant. Answer briefly and honestly.
User: Explain photosynthesis in one sentence.
Assistant: Plants use sunlight, water, and carbon dioxide to produce sugar and release oxygen.
User: Write a haiku about autumn.
Assistant: Crimson leaves drifting, quiet wind across the pond, evening comes early.
User: Translate "thank you" into Spanish.
Assistant: In Spanish, "thank you" is "gracias".
The astronomer pointed her telescope toward Jupiter and sketched its four brightest moons.
Volcanoes, earthquakes, glaciers, and rivers slowly reshape the surface of the planet.
Our neighbors adopted a playful puppy, a sleepy kitten, and an extremely curious parrot.
The orchestra tuned their violins, cellos, flutes, trumpets, and drums before the concert.
Engineers designed a lighter bridge using steel cables, concrete towers, and careful calculations.
Vegetables such as carrots, potatoes, onions, cabbage, spinach, and beans grow in the northern fields.
The hospital hired additional nurses, surgeons, pharmacists, and volunteers during the epidemic.
Electricity flows through copper wires, powering lamps, refrigerators, computers, and elevators.
The detective examined footprints, fingerprints, receipts, and a torn photograph near the fireplace.
Thunderstorms developed quickly over the prairie, bringing hail, lightning, and powerful gusts.
Ancient philosophers debated justice, virtue, friendship, courage, and the nature of knowledge.
Farmers harvested barley, oats, corn, and rice, then stored everything in enormous wooden barns.
The museum displayed sculptures, pottery, jewelry, coins, and manuscripts from forgotten kingdoms.
Penguins, seals, whales, and albatrosses survive in the freezing southern ocean.
The programmer fixed a subtle bug, wrote documentation, and reviewed several pull requests.
Databases keep records in tables, while indexes make searching through millions of rows faster.
Memory, bandwidth, latency, and throughput determine how quickly a computer finishes a job.
The kitchen smelled of garlic, basil, tomatoes, lemon, olive oil, and freshly baked bread.
Mountaineers carried ropes, helmets, lanterns, blankets, and dried fruit toward the summit.
Her favorite hobbies were gardening, knitting, cycling, swimming, reading poetry, and chess.
The government announced new policies about taxes, education, transport, housing, and energy.
A volcano erupted somewhere beneath the ocean, creating a brand new island within weeks.
Young athletes practiced running, jumping, throwing, climbing, and balancing every afternoon.
The carpenter measured twice, cut once, sanded the edges, and polished the finished table.
Honeybees visit thousands of flowers, gathering nectar and pollen for their crowded hive.
Lighthouses guided sailors safely past dangerous rocks, reefs, and shallow sandbanks.
The professor graded exams, answered emails, attended meetings, and prepared tomorrow's lecture.
Children built snowmen, threw snowballs, drank cocoa, and warmed their fingers by the stove.
Satellites orbit Earth, photographing weather systems, forests, deserts, and melting icebergs.
The novelist imagined kingdoms, villains, heroes, prophecies, and secret underground tunnels.
Doctors recommend vegetables, fruit, exercise, sleep, sunshine, and fewer sugary drinks.
A lonely wolf howled beneath the moon, answered faintly by coyotes across the canyon.
The festival included fireworks, parades, puppets, dancing, lanterns, and delicious street food.
Bicycle repair requires wrenches, screwdrivers, grease, spare tubes, and plenty of patience.
Chemists combined hydrogen, oxygen, nitrogen, and carbon to build complicated molecules.
The airport was crowded with tourists, pilots, porters, businessmen, and tired families.
Grandfather repaired clocks, radios, typewriters, and sewing machines in his tiny workshop.
Clouds gathered over the harbor; fishermen secured their nets and hurried their boats home.
Architects sketched windows, balconies, staircases, courtyards, and gently curving roofs.
The village celebrated the harvest with pumpkins, cider, pies, music, and a bonfire.
Rabbits, squirrels, hedgehogs, foxes, and owls live quietly in the forest near our cottage.
Journalists interviewed witnesses, verified quotes, checked facts, and published the report.
An umbrella, a sandwich, a notebook, keys, and a wallet were found on the abandoned bench.
Quantum physics describes particles that behave like waves and waves that behave like particles.
The marathon route passed cathedrals, bridges, markets, parks, and the old university.
Dinosaurs roamed prehistoric continents millions of years before humans appeared.
She practiced piano scales slowly, then faster, until her fingers moved without thinking.
Wildflowers bloomed along the railway: poppies, lupins, violets, buttercups, and clover.
The submarine descended silently, its sonar searching the darkness for underwater canyons.
Vocabulary grows when curious readers explore newspapers, encyclopedias, comics, and plays.
Calendars divide time into years, months, weeks, days, hours, minutes, and seconds.
Pirates buried treasure chests containing gold, silver, emeralds, rubies, and ancient maps.
The recipe requires flour, butter, sugar, eggs, vanilla, milk, and a pinch of salt.
Please summarize the following paragraph, list three key points, and suggest a title.
Configuration files define ports, paths, timeouts, thresholds, and logging verbosity.
Requests arrive concurrently; the scheduler decides which sequences run during each iteration.
Blocks of memory hold cached keys and values, and freed blocks return to the shared pool.
"""


def demo_model_path() -> Path:
    """Folder of the shipped demo model: a standard Hugging Face folder, read-only, no build step."""
    missing = [name for name in DEMO_MODEL_FILES if not (DEMO_MODEL_DIR / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"{DEMO_MODEL_DIR}: demo model file(s) {missing} missing; install tokenmill with its "
            "package data, or rebuild them with scripts/train_demo_model.py"
        )
    return DEMO_MODEL_DIR


DEMO_DRAFT_DIR = Path(__file__).resolve().with_name("demo_draft_weights")
"""``demo-draft``: the demo's speculative-decoding draft, shipped beside it (one decoder layer
with the demo's dims and tokenizer, distilled from the demo by ``scripts/train_demo_model.py
--train-draft``; ``training.json`` there records the run)."""
DEMO_DRAFT_LAYERS = 2
"""Decoder layers of the untrained fallback draft (of the demo's 4)."""


def demo_draft_path() -> Path:
    """``demo-draft``: the shipped, trained draft; where the package data lacks it, an
    untrained stand-in built on first use under ``$TOKENMILL_CACHE`` (the demo's first
    ``DEMO_DRAFT_LAYERS`` layers, embeddings, final norm and LM head), with a warning."""
    import logging

    from tokenmill import envs

    if all((DEMO_DRAFT_DIR / name).is_file() for name in DEMO_MODEL_FILES):
        return DEMO_DRAFT_DIR
    logging.getLogger(__name__).warning(
        "%s missing: demo-draft falls back to an untrained truncation of the demo", DEMO_DRAFT_DIR
    )
    cache = envs.cache_root()
    folder = cache / f"demo-draft-{DEMO_DRAFT_LAYERS}"
    if not (folder / "model.safetensors").is_file():
        build_truncated_draft(demo_model_path(), folder, DEMO_DRAFT_LAYERS)
    return folder


def build_truncated_draft(source: Path, folder: Path, num_layers: int) -> None:
    """A Llama-style folder keeping the first ``num_layers`` decoder layers of ``source``
    (same tokenizer, embeddings and head), written atomically."""
    import shutil
    import tempfile

    from safetensors.torch import load_file, save_file

    config = json.loads((source / "config.json").read_text())
    if num_layers >= config["num_hidden_layers"]:
        raise ValueError(f"a draft needs fewer than {config['num_hidden_layers']} layers")
    config["num_hidden_layers"] = num_layers
    tensors = {
        name: tensor
        for name, tensor in load_file(source / "model.safetensors").items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=folder.name + "."))
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    _write_json(tmp / "config.json", config)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, tmp / name)
    try:
        tmp.rename(folder)
    except OSError:  # built meanwhile by another process
        shutil.rmtree(tmp, ignore_errors=True)


def build_bpe_tokenizer(
    folder: str | Path,
    corpus: str | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    chat_template: str | None = CHATML_TEMPLATE,
    model_max_length: int = 2048,
) -> Tokenizer:
    """Train a byte-level BPE on ``corpus`` and write tokenizer.json + tokenizer_config.json.

    Special tokens get ids 0..3: ``<s>`` (BOS, added by the post-processor), ``</s>``
    (EOS), ``<|im_start|>``, ``<|im_end|>``. The vocabulary stops short of ``vocab_size``
    when the corpus has nothing left to merge. Returns the trained ``tokenizers.Tokenizer``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = (DEMO_CORPUS if corpus is None else corpus).splitlines()
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Lines keep their newline so the model learns "\n" pieces used by the chat template.
    tokenizer.train_from_iterator([line + "\n" for line in lines], trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN}:0 $A:0",
        pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    tokenizer.save(str(folder / "tokenizer.json"))

    added_tokens_decoder = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "added_tokens_decoder": added_tokens_decoder,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    _write_json(folder / "tokenizer_config.json", config)
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
