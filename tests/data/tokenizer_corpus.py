"""Deterministic tokenizer test corpus: hand-written edge cases plus generated strings of every kind the
tokenizer agreement test needs (English prose, source code, numbers, whitespace runs, Chinese, Japanese, Korean,
emoji, combining marks, special-token strings, mixed scripts, random Unicode).

    python3 tests/data/tokenizer_corpus.py [N] > corpus.jsonl     # one JSON string per line

corpus(n) always returns the same strings for the same n (Python's random with a fixed seed).
"""
import json
import random
import sys

EDGE = [
    "", " ", "  ", "\n", "\n\n", "\t", " \n ", "a", "Hello world", " Hello world", "Hello  world", "Hello\n\nworld",
    "I'm you're we've they'll she'd it's can't", "I'M YOU'RE WE'VE THEY'LL", "'s 't 're 've 'm 'll 'd", "''s'",
    "don'T", "x'ſ",
    "12345", "3.14159", "1,000,000", "2026-11-29T10:00:00Z", "0x1F600", "1e-9", "v1.2.3", "#123", "$9.99", "50%",
    "   leading", "trailing   ", "   both   ", "tabs\t\tand\tspaces", "a \t\n b", "\r\n\r\nwindows\r\n",
    " " * 100, "\n" * 50, "\t" * 33, " \u00a0\u2003\u3000 ",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHi<|im_end|>\n",
    "a<|im_start|>b", "<|im_start|><|im_end|>", "<|im_start", "<|im_end|", "<|im_start|>>", "<<|im_end|>",
    "<repo_name>x<file_sep>y<filename>z", "<jupyter_code>print(1)<jupyter_output>1<empty_output>",
    "<s>", "</s>", "<unk>", "[INST]", "<|eot_id|>",
    "你好，世界！", "中华人民共和国", "日本語のテキストです。カタカナとひらがな。", "東京都渋谷区",
    "안녕하세요, 세계!", "한국어 텍스트", "Привет, мир!", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया", "สวัสดีชาวโลก",
    "🙂", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷🇯🇵", "❤️", "🏳️‍🌈", "emoji 😀😃😄 run", "a😀b",
    "e\u0301", "n\u0303", "a\u0308\u0304", "Z\u0351\u0352\u0357\u035b\u0346\u033e", "\u0301leading mark",
    "café", "cafe\u0301", "Ångström", "naïve", "ﬁ ligature", "Ｆｕｌｌｗｉｄｔｈ", "½ ¾ ² ³ Ⅻ ① ٣ ৩",
    "\u200b\u200c\u200d\ufeff", "\u0000\u0001\u001f\u007f", "\ud7ff\ue000\uffff", "\U0001F600\U00010000\U0010FFFF",
    "def f(x):\n    return x ** 2\n", "int main(void) { return 0; }", "for (i = 0; i < n; i++) {\n\tsum += a[i];\n}",
    "#include <stdio.h>\n", "SELECT * FROM t WHERE id = 42;", "<div class=\"x\">hi</div>", "{\"a\": [1, 2, {\"b\": null}]}",
    "https://example.com/path?q=1&r=2#frag", "user@example.org", "C:\\Windows\\System32", "a->b", "x != y && y >= z",
    "!!!???...", "---", "___init___", "`code`", "**bold**", "~~~", "(((nested)))", "a.b.c.d", "...\n...",
]

WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
         "they you were her she there one all we their can has been if more when will would who so no time about "
         "people out up into just them could only other then now its like over also back after use two how our work "
         "first well way even new want because any these give day most us model token cache prefill decode batch "
         "router node cluster latency throughput request stream Europe Paris London October Monday").split()

CODE_LINES = [
    "def {f}({a}, {b}):", "    return {a} + {b} * {n}", "    if {a} is None:", "        raise ValueError('{w}')",
    "for {a} in range({n}):", "    {b} += {a} ** 2", "class {F}(object):", "    def __init__(self, {a}={n}):",
    "int {f}(const char *{a}, size_t {b}) {{", "    for (size_t i = 0; i < {b}; i++) {a}[i] ^= 0x{h};",
    "    return {n};", "}}", "#define {F} ({n}u << {m})", "static inline uint32_t {f}(uint32_t {a});",
    "const {a} = await fetch(`/api/{w}/${{{b}}}`);", "let {a}: Vec<u8> = vec![{n}; {m}];",
    "{a} = [x for x in {b} if x % {m} == 0]", "# {w} {w2}: TODO(fix) {n}", "// {w} {w2}", "/* {w} */",
    "SELECT {a}, COUNT(*) FROM {b} GROUP BY {a};", "<{w} id=\"{a}\">{w2}</{w}>", "\t{a}\t=\t{n}\t;",
]

CJK = "的一是不了人我在有他这中大来上国个到说们为子和你地出道也时年得就那要下以生会自着去之过家学对可她里后小么心多天而能好都然没日于起还发成事只作当想看文无开手十用主行方又如前所本见经头面公同三已老从动两长知民样现分将外但身些与高意进把法此实回二理美点月明其种声全工己话儿者向情部正名定女问力机给等几很业最间新什打便位因重被走电四第门相次东政海口使教西再平真听世气信北少关并内加化由却代军产入先山五太水万市眼体别处总才场师书比住员九笑性通目华报立马命张活难神数件安表原车白应路期叫死常提感金何更反合放做系计或司利受光王果亲界及今京务制解各任至清物台象记边共风战干接它许八特觉望直服毛林题建南度统色字请交爱让认算论百吃义科怎元社术结六功指思非流每青管夫连远资队跟带花快条院变联言权往展该领传近留红治决周保达办运武半候七必城父强步完革深区即求品士转量空甚众技轻程告江语英基派满式李息写呢识极令黄德收脸钱党倒未持取设始版双历越史商千片容研像找友孩站广改议形委早房音火际则首单据导影失拿网香似斯专石若兵弟谁校读志飞观争究包组造落视济喜离虽坏兴切米"
HIRAGANA = "あいうえおかきくけこさしすせそたちつてとなにぬねのはひふへほまみむめもやゆよらりるれろわをんがぎぐげござじずぜぞだぢづでどばびぶべぼぱぴぷぺぽゃゅょっ"
KATAKANA = "アイウエオカキクケコサシスセソタチツテトナニヌネノハヒフヘホマミムメモヤユヨラリルレロワヲンガギグゲゴザジズゼゾダヂヅデドバビブベボパピプペポャュョッー"
EMOJI = ["😀", "😂", "🥲", "😍", "🤖", "👍", "👍🏻", "👍🏿", "🙏", "🔥", "✨", "🎉", "❤️", "💯", "🚀", "🌍", "🇺🇸", "🇩🇪",
         "👩‍💻", "🧑‍🚀", "👨‍👩‍👧", "🏳️‍⚧️", "☕", "⭐", "✅", "❌", "🦀", "🐍", "1️⃣", "#️⃣"]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<filename>", "<gh_stars>", "<reponame>",
            "<issue_start>", "<issue_comment>", "<jupyter_text>", "<s>", "</s>", "<unk>", "<|im_start", "im_end|>"]
MARKS = [chr(c) for c in list(range(0x300, 0x36F)) + [0x483, 0x591, 0x5B4, 0x64B, 0x93C, 0x9BC, 0x1AB0, 0x1DC0,
                                                         0x20D0, 0x20E3, 0x302A, 0xFE20]]


def _hangul(rng, n):
    return "".join(chr(0xAC00 + rng.randrange(11172)) for _ in range(n))


def _word(rng):
    w = rng.choice(WORDS)
    r = rng.random()
    if r < 0.1:
        return w.capitalize()
    if r < 0.13:
        return w.upper()
    return w


def prose(rng):
    out = []
    for _ in range(rng.randint(1, 4)):
        words = [_word(rng) for _ in range(rng.randint(3, 18))]
        words[0] = words[0].capitalize()
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), rng.choice(["don't", "it's", "we'll", "I'm", "they've", "she'd",
                                                                "you're", "O'Brien", "'quoted'", "\"q\""]))
        s = " ".join(words)
        s += rng.choice([".", ".", "!", "?", "...", ":", ";", ","])
        out.append(s)
    return rng.choice([" ", " ", "  ", "\n", "\n\n"]).join(out)


def code(rng):
    lines = []
    for _ in range(rng.randint(1, 8)):
        tmpl = rng.choice(CODE_LINES)
        lines.append(tmpl.format(f=rng.choice(["parse", "run_step", "kvGet", "_init", "compute2"]),
                                 F=rng.choice(["Node", "MAX_BLOCKS", "KvPool", "HTTPServer"]),
                                 a=rng.choice(["x", "buf", "n_tokens", "self.items", "ptr", "i"]),
                                 b=rng.choice(["y", "len", "blocks", "other", "cap"]),
                                 n=rng.randint(0, 100000), m=rng.randint(1, 31), h="%X" % rng.randrange(1 << 16),
                                 w=rng.choice(WORDS), w2=rng.choice(WORDS)))
    indent = rng.choice(["", "", "    ", "\t"])
    return "\n".join(indent + line for line in lines) + rng.choice(["", "\n"])


def numbers(rng):
    parts = []
    for _ in range(rng.randint(1, 6)):
        k = rng.randrange(7)
        if k == 0:
            parts.append(str(rng.randrange(10 ** rng.randint(1, 20))))
        elif k == 1:
            parts.append("%.*f" % (rng.randint(1, 6), rng.uniform(-1e6, 1e6)))
        elif k == 2:
            parts.append("{:,}".format(rng.randrange(10 ** 10)))
        elif k == 3:
            parts.append("%d/%d/%04d" % (rng.randint(1, 12), rng.randint(1, 31), rng.randint(1900, 2100)))
        elif k == 4:
            parts.append("0x%x" % rng.randrange(1 << 32))
        elif k == 5:
            parts.append("%de%d" % (rng.randint(1, 9), rng.randint(-30, 30)))
        else:
            parts.append("".join(rng.choice("0123456789٠١٢٣४५६௧௨໑໒१२３４½²") for _ in range(rng.randint(1, 8))))
    return rng.choice([" ", ", ", "\n", "+", " x "]).join(parts)


def whitespace(rng):
    out = []
    for _ in range(rng.randint(1, 6)):
        out.append("".join(rng.choice([" ", " ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2009", "\r", "\x0b", "\x0c"])
                           for _ in range(rng.randint(1, 80))))
        if rng.random() < 0.8:
            out.append(rng.choice([_word(rng), "x", "1", "!", "你好", "😀", "'s"]))
    return "".join(out)


def chinese(rng):
    s = "".join(rng.choice(CJK) for _ in range(rng.randint(1, 40)))
    if rng.random() < 0.5:
        s = s[: len(s) // 2] + rng.choice(["，", "。", "、", "！", "？", "：", " ", "（测试）", "“引号”"]) + s[len(s) // 2:]
    return s


def japanese(rng):
    pieces = []
    for _ in range(rng.randint(1, 8)):
        src = rng.choice([HIRAGANA, KATAKANA, CJK])
        pieces.append("".join(rng.choice(src) for _ in range(rng.randint(1, 6))))
    return rng.choice(["", "。", "、", " "]).join(pieces) + rng.choice(["", "。", "です。", "！"])


def korean(rng):
    return " ".join(_hangul(rng, rng.randint(1, 6)) for _ in range(rng.randint(1, 8))) + rng.choice(["", ".", "?", "!"])


def emoji(rng):
    out = []
    for _ in range(rng.randint(1, 10)):
        out.append(rng.choice(EMOJI) * rng.randint(1, 3))
        if rng.random() < 0.5:
            out.append(rng.choice([" ", "", " and ", "!", _word(rng), "\n"]))
    return "".join(out)


def marks(rng):
    out = []
    for _ in range(rng.randint(1, 10)):
        out.append(rng.choice("aeiouAEIOUnzxyks ") if rng.random() < 0.8 else rng.choice(CJK))
        for _ in range(rng.choice([0, 1, 1, 2, 5])):
            out.append(rng.choice(MARKS))
    return "".join(out)


def special(rng):
    parts = []
    for _ in range(rng.randint(1, 6)):
        parts.append(rng.choice(SPECIALS) if rng.random() < 0.5 else rng.choice([prose(rng), " ", "\n", "x", "你好"]))
    return rng.choice(["", "", " ", "\n"]).join(parts)


def mixed(rng):
    gens = [prose, code, numbers, whitespace, chinese, japanese, korean, emoji, marks, special]
    return "".join(rng.choice(gens)(rng) for _ in range(rng.randint(2, 4)))


def random_unicode(rng):
    # Draws from assigned-looking ranges across the planes, avoiding surrogates (not valid in UTF-8).
    ranges = [(0x20, 0x7E), (0xA0, 0x2FF), (0x370, 0x52F), (0x590, 0x6FF), (0x900, 0xDFF), (0x1100, 0x11FF),
              (0x1E00, 0x1FFF), (0x2000, 0x2BFF), (0x3000, 0x30FF), (0x4E00, 0x9FFF), (0xAC00, 0xD7A3),
              (0xE000, 0xE0FF), (0xF900, 0xFFFD), (0x10000, 0x1034F), (0x1D400, 0x1D7FF), (0x1F000, 0x1FAFF),
              (0x20000, 0x2A6DF), (0xE0000, 0xE007F), (0x0, 0x1F)]
    out = []
    for _ in range(rng.randint(1, 30)):
        a, b = rng.choice(ranges)
        out.append(chr(rng.randint(a, b)))
    return "".join(out)


KINDS = [prose, code, numbers, whitespace, chinese, japanese, korean, emoji, marks, special, mixed, random_unicode]


def corpus(n=2400, seed=20261129):
    rng = random.Random(seed)
    out = list(EDGE)
    while len(out) < n:
        out.append(KINDS[len(out) % len(KINDS)](rng))
    return out[:max(n, len(EDGE))]


if __name__ == "__main__":
    for s in corpus(int(sys.argv[1]) if len(sys.argv) > 1 else 2400):
        print(json.dumps(s))
