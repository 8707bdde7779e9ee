"""Deterministic same-domain filler: the prose that surrounds evidence in a layout.

Filler is the text of a fictional company operations handbook (research/gemma_position_pilot.md §3):
sentences "{Department} staff {action} {object} {timing}.", about 15% generic handbook sentences, and a
section heading about every 7 sentences. It is realistic enough that a model cannot skip it as noise, and it
never mentions regions, hotel rates, supplier invoices, security-incident contacts, sign-offs or any other
fact the generated cases ask about, so filler can never support or contradict an answer.

The contract the layout engine relies on (checked by
:func:`depthgate.spec.text_checks.unit_contract_violation`):

* every unit starts with exactly one separator: ``"\\n\\n"`` for a heading that opens a section,
  ``"\\n"`` for the first sentence after a heading, ``" "`` for a sentence continuing a paragraph; the
  separator is followed by a non-whitespace character and the unit ends with one;
* no unit contains a special-token-like string;
* ``filler_units(seed, language, n)`` is a prefix of ``filler_units(seed, language, n + k)`` and the same
  arguments always give the same list, on every machine and Python version.

The last point is why the randomness is :class:`SplitMix64` keyed by a sha256 of the arguments, and not
:mod:`random`: its integer helpers (``randrange``, ``shuffle``) are not guaranteed stable across Python
versions, and the algorithm is a dozen lines that the Rust core can reproduce bit for bit.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from functools import lru_cache
from typing import Literal, TypeVar

from depthgate.exceptions import SpecError

T = TypeVar("T")

_MASK64 = (1 << 64) - 1

DOMAINS = ("operations",)


class SplitMix64:
    """A tiny portable PRNG (Steele, Lea & Flood 2014). Keyed by the sha256 of its key parts.

    ``below(n)`` maps a 64-bit draw to ``[0, n)`` by multiply-high (Lemire), without rejection: the bias is
    below n / 2**64, irrelevant here, and the mapping is trivial to reproduce in another language.
    """

    def __init__(self, *key: object) -> None:
        material = "\x1f".join(str(part) for part in key).encode("utf-8")
        self.state = int.from_bytes(hashlib.sha256(material).digest()[:8], "little")

    def next_u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        """A draw from ``range(n)``; ``n`` must be positive."""
        if n <= 0:
            raise ValueError("below() needs a positive bound")
        return (self.next_u64() * n) >> 64

    def chance(self, percent: int) -> bool:
        """True with probability ``percent`` / 100."""
        return self.below(100) < percent

    def choice(self, items: Sequence[T]) -> T:
        return items[self.below(len(items))]

    def shuffle(self, items: list[T]) -> None:
        """Fisher-Yates, from the last element down, in place."""
        for i in range(len(items) - 1, 0, -1):
            j = self.below(i + 1)
            items[i], items[j] = items[j], items[i]

    def sample(self, items: Sequence[T], k: int) -> list[T]:
        """``k`` distinct elements in draw order (a partial Fisher-Yates from the front)."""
        pool = list(items)
        if not 0 <= k <= len(pool):
            raise ValueError("sample larger than population")
        for i in range(k):
            j = i + self.below(len(pool) - i)
            pool[i], pool[j] = pool[j], pool[i]
        return pool[:k]


# --------------------------------------------------------------------------------------------------------
# Vocabulary. Nothing here may mention regions, hotels or travel rates, invoices or payment terms, security
# incidents or whom to report them to, approvals or sign-offs, money or digits (tests/test_filler.py checks).


class _Vocabulary:
    def __init__(
        self,
        *,
        departments: tuple[str, ...],
        actions: tuple[str, ...],
        objects: tuple[str, ...],
        timings: tuple[str, ...],
        generic: tuple[str, ...],
        titles: tuple[str, ...],
        short_subjects: tuple[str, ...],
        short_predicates: tuple[str, ...],
        benefits: tuple[str, ...],
    ) -> None:
        self.departments = departments
        self.actions = actions
        self.objects = objects
        self.timings = timings
        self.generic = generic
        self.titles = titles
        self.short_subjects = short_subjects
        self.short_predicates = short_predicates
        self.benefits = benefits


_EN = _Vocabulary(
    departments=(
        "Legal",
        "Internal audit",
        "Corporate security",
        "Warehouse",
        "Procurement",
        "Facilities",
        "Human resources",
        "IT service desk",
        "Payroll",
        "Reception",
        "Quality assurance",
        "Logistics",
        "Customer support",
        "Marketing",
        "Training",
        "Records management",
        "Health and safety",
        "Fleet management",
    ),
    actions=(
        "must verify",
        "should review",
        "must report any changes to",
        "are responsible for updating",
        "must archive",
        "should confirm",
        "must log",
        "should check",
        "must file",
        "are expected to reconcile",
        "should keep a record of",
        "must inspect",
        "should tidy up",
        "must collect",
        "should schedule",
        "must return",
    ),
    objects=(
        "parking permit requests",
        "badge access logs",
        "meeting room bookings",
        "equipment loan forms",
        "visitor badges",
        "training attendance sheets",
        "fire drill records",
        "shared drive folders",
        "locker assignments",
        "delivery schedules",
        "stationery orders",
        "printer maintenance requests",
        "desk booking records",
        "first aid kits",
        "software licence lists",
        "key cabinet records",
        "notice board postings",
        "cleaning rotas",
        "archive boxes",
        "courier bookings",
        "laptop loan records",
        "kitchen supply lists",
        "mailroom logs",
        "floor plan updates",
        "safety signage",
        "onboarding checklists",
    ),
    timings=(
        "during the first week of each month",
        "before a new employee starts",
        "when a request is received",
        "before the monthly close",
        "at the end of each quarter",
        "every Friday afternoon",
        "within two working days",
        "before the office closes for the holidays",
        "after each team meeting",
        "at the start of every shift",
        "once a year",
        "whenever a manager asks",
        "before an office move",
        "on the last working day of the month",
        "as soon as a change is known",
        "during the annual review",
    ),
    generic=(
        "Printed copies of this handbook may be out of date.",
        "All forms referenced in this section are available on the intranet.",
        "Questions about this section can be sent to the office manager.",
        "Team leads should make sure new colleagues read this section.",
        "The intranet version of this handbook is the reference copy.",
        "Local offices may add practical notes to this section.",
        "Colleagues should use the shared calendar for room planning.",
        "Templates for the forms in this section are kept on the shared drive.",
        "This section is reviewed together with the facilities team.",
        "Comments on this handbook are welcome at any time.",
        "Managers should point new staff to the relevant forms.",
        "Older paper forms should be replaced by their online versions.",
        "The office manager keeps a list of current contacts for each team.",
        "Where a form is unclear, ask the team that owns it.",
        "Each team keeps its own checklist for recurring tasks.",
        "Notes taken at team meetings are stored on the shared drive.",
        "Requests made by chat should be confirmed by email.",
        "Office opening hours are shown at the main entrance.",
        "Lost property is kept at the front desk for one month.",
        "Shared equipment should be returned in the condition it was borrowed.",
        "The weekly newsletter summarises changes to this handbook.",
        "Colleagues working remotely follow the same procedures.",
        "Every team names a deputy for planned absences.",
        "Temporary staff receive a short version of this handbook.",
        "Forms should be completed in full before they are submitted.",
        "Keep desks clear at the end of the working day.",
        "Meeting rooms should be left tidy for the next group.",
        "Suggestions for improving these procedures can be made on the intranet.",
    ),
    titles=(
        "Visitor management",
        "Internal communication",
        "Office facilities",
        "Equipment loans",
        "Workplace safety",
        "Records and archiving",
        "Onboarding",
        "Meeting rooms",
        "Parking and building access",
        "Mail and deliveries",
        "Training",
        "Shared services",
        "Cleaning and maintenance",
        "IT support",
        "Office moves",
        "Supplies and stationery",
        "Health and safety",
        "Document control",
        "Quality checks",
        "Fleet and vehicles",
    ),
    short_subjects=(
        "Forms",
        "Badges",
        "Keys",
        "Lockers",
        "Rotas",
        "Checklists",
        "Archive boxes",
        "Desk bookings",
        "Meeting rooms",
        "Printers",
        "Parking permits",
        "Visitor lists",
        "Floor plans",
        "Notice boards",
        "Kitchen supplies",
        "Delivery slots",
        "Loan laptops",
        "Training places",
        "Safety signs",
        "Shared folders",
    ),
    short_predicates=(
        "are online.",
        "are personal.",
        "are numbered.",
        "are shared.",
        "are reviewed monthly.",
        "stay locked.",
        "are labelled.",
        "stay on site.",
        "are checked weekly.",
        "are limited.",
        "fill quickly.",
        "change yearly.",
    ),
    benefits=(
        "nothing is lost when teams change",
        "colleagues always find the latest version",
        "the next shift can continue without delay",
        "questions can be answered quickly",
        "the office stays tidy and safe",
        "the same task is not done twice",
        "new colleagues can follow the steps on their own",
        "planning for the next month is easier",
    ),
)

_ZH = _Vocabulary(
    departments=(
        "法务部",
        "内审部",
        "企业安保部",
        "仓储部",
        "采购部",
        "行政后勤部",
        "人力资源部",
        "信息技术服务台",
        "薪酬组",
        "前台",
        "质量保证部",
        "物流部",
        "客户支持部",
        "市场部",
        "培训部",
        "档案管理部",
        "健康安全部",
        "车队管理部",
    ),
    # "{department}员工{modal}{timing}{verb}{object}。" — modal and verb are joined around the timing
    actions=(
        "须|核对",
        "应|审查",
        "应|汇总",
        "负责|更新",
        "须|归档",
        "应|确认",
        "须|登记",
        "应|检查",
        "须|提交",
        "应|核实",
        "应|妥善保管",
        "须|巡查",
        "应|整理",
        "须|收集",
        "应|安排",
        "须|归还",
    ),
    objects=(
        "停车许可申请",
        "门禁记录",
        "会议室预订",
        "设备借用单",
        "访客胸卡",
        "培训签到表",
        "消防演练记录",
        "共享文件夹",
        "储物柜分配",
        "配送时间表",
        "文具订单",
        "打印机维修申请",
        "工位预订记录",
        "急救箱",
        "软件许可清单",
        "钥匙柜记录",
        "公告栏张贴内容",
        "保洁排班表",
        "档案盒",
        "快递预约",
        "笔记本电脑借用记录",
        "茶水间物资清单",
        "收发室登记簿",
        "楼层平面图",
        "安全标识",
        "入职清单",
    ),
    timings=(
        "在每月第一周",
        "在新员工入职前",
        "在收到申请后",
        "在月度结账前",
        "在每季度末",
        "在每周五下午",
        "在两个工作日内",
        "在节假日闭馆前",
        "在每次团队会议后",
        "在每个班次开始时",
        "在年度检查时",
        "在经理提出要求时",
        "在办公室搬迁前",
        "在每月最后一个工作日",
        "在得知变化后尽快",
        "在年度复盘期间",
    ),
    generic=(
        "本手册的纸质版本可能不是最新版本。",
        "本节提到的所有表格均可在内网上获取。",
        "对本节有疑问的员工可以联系办公室经理。",
        "团队负责人应确保新同事阅读本节内容。",
        "内网上的手册版本为正式参考版本。",
        "各地办公室可以在本节中补充实用说明。",
        "同事们应使用共享日历安排会议室。",
        "本节所列表格的模板保存在共享盘中。",
        "本节内容与行政后勤团队一起定期复核。",
        "欢迎随时对本手册提出意见。",
        "经理应引导新员工找到相关表格。",
        "旧的纸质表格应改用在线版本。",
        "办公室经理保存各团队的当前联系人名单。",
        "如对表格有疑问，请咨询负责该表格的团队。",
        "每个团队都为例行工作保留自己的清单。",
        "团队会议记录保存在共享盘中。",
        "通过聊天提出的请求应再用邮件确认。",
        "办公室开放时间张贴在正门处。",
        "失物在前台保管一个月。",
        "借用的共享设备应按原样归还。",
        "每周简报会汇总本手册的变化。",
        "远程办公的同事遵循相同的流程。",
        "每个团队都为计划内的缺勤指定代理人。",
        "临时员工会收到本手册的简要版本。",
        "表格应填写完整后再提交。",
        "下班时请保持桌面整洁。",
        "会议室使用后应为下一组人保持整洁。",
        "改进这些流程的建议可以在内网上提出。",
    ),
    titles=(
        "访客管理",
        "内部沟通",
        "办公设施",
        "设备借用",
        "工作场所安全",
        "记录与归档",
        "入职",
        "会议室",
        "停车与门禁",
        "邮件与快递",
        "培训",
        "共享服务",
        "保洁与维护",
        "信息技术支持",
        "办公室搬迁",
        "办公用品",
        "健康与安全",
        "文件管理",
        "质量检查",
        "车辆管理",
    ),
    short_subjects=(
        "表格",
        "胸卡",
        "钥匙",
        "储物柜",
        "排班表",
        "清单",
        "档案盒",
        "工位预订",
        "会议室",
        "打印机",
        "停车证",
        "访客名单",
        "平面图",
        "公告栏",
        "茶水间物资",
        "配送时段",
        "借用电脑",
        "培训名额",
        "安全标识",
        "共享文件夹",
    ),
    short_predicates=(
        "在内网上。",
        "仅限本人使用。",
        "均已编号。",
        "可以共享。",
        "每月复核。",
        "需上锁保管。",
        "均有标签。",
        "不得带离。",
        "每周检查。",
        "数量有限。",
        "很快用完。",
        "每年更换。",
    ),
    benefits=(
        "团队变动时不会遗失资料",
        "同事总能找到最新版本",
        "下一班次可以立即接手",
        "问题能够尽快得到解答",
        "办公室保持整洁安全",
        "同一项工作不会重复进行",
        "新同事可以独立按步骤操作",
        "下个月的计划更容易安排",
    ),
)

_VOCABULARIES = {"en": _EN, "zh": _ZH}


def _vocabulary(language: str, domain: str) -> _Vocabulary:
    if domain not in DOMAINS:
        raise SpecError(
            f"unknown filler domain {domain!r}", field="domain", fix=f"use one of {list(DOMAINS)}"
        )
    vocabulary = _VOCABULARIES.get(language)
    if vocabulary is None:
        raise SpecError(f"unknown filler language {language!r}", field="language", fix="use 'en' or 'zh'")
    return vocabulary


def _check_count(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError(f"{value!r} is not a count", field=name, fix="give a non-negative integer")


# --------------------------------------------------------------------------------------------------------
# Sentences


def _template_sentence(v: _Vocabulary, language: str, rng: SplitMix64, *, timing: bool = True) -> str:
    department, action, obj = rng.choice(v.departments), rng.choice(v.actions), rng.choice(v.objects)
    when = rng.choice(v.timings) if timing else ""
    if language == "zh":
        modal, verb = action.split("|")
        return f"{department}员工{modal}{when}{verb}{obj}。"
    return f"{department} staff {action} {obj}{' ' + when if when else ''}."


def _clause(v: _Vocabulary, language: str, rng: SplitMix64) -> str:
    """A template sentence without its final punctuation, lower-cased at the start for English."""
    sentence = _template_sentence(v, language, rng, timing=False)[:-1]
    if language == "en" and not sentence.startswith("IT "):
        sentence = sentence[0].lower() + sentence[1:]
    return sentence


def _heading(v: _Vocabulary, language: str, number: int, title: str) -> str:
    if language == "zh":
        return f"\n\n第{number}节：{title}。"
    return f"\n\nSection {number}. {title}."


class _FillerStream:
    """The infinite filler sequence of one (seed, language, domain), materialised on demand."""

    def __init__(self, seed: int, language: str, domain: str) -> None:
        self.vocabulary = _vocabulary(language, domain)
        self.language = language
        self.rng = SplitMix64("depthgate/filler/units/v1", domain, language, seed)
        self.units: list[str] = []
        self.section = 0
        self.titles: list[str] = []
        self.recent: deque[str] = deque(maxlen=64)

    def _next_title(self) -> str:
        if not self.titles:
            titles = list(self.vocabulary.titles)
            self.rng.shuffle(titles)
            self.titles = titles
        return self.titles.pop()

    def _sentence(self) -> str:
        v = self.vocabulary
        sentence = ""
        for _ in range(8):  # avoid repeating one of the last 64 sentences
            if self.rng.chance(15):
                sentence = self.rng.choice(v.generic)
            else:
                sentence = _template_sentence(v, self.language, self.rng)
            if sentence not in self.recent:
                break
        self.recent.append(sentence)
        return sentence

    def extend(self, count: int) -> None:
        while len(self.units) < count:
            self.section += 1
            self.units.append(_heading(self.vocabulary, self.language, self.section, self._next_title()))
            sentences = 5 + self.rng.below(5)  # 5..9 sentences: a heading about every 7 sentences
            for index in range(sentences):
                self.units.append(("\n" if index == 0 else " ") + self._sentence())


@lru_cache(maxsize=16)
def _stream(seed: int, language: str, domain: str) -> _FillerStream:
    return _FillerStream(seed, language, domain)


def filler_units(
    seed: int, language: Literal["en", "zh"] | str, count: int, *, domain: str = "operations"
) -> list[str]:
    """The first ``count`` filler units of the (seed, language, domain) stream.

    Unit 0 is a section heading (``"\\n\\nSection 1. ..."``), unit 1 the first sentence of that section
    (``"\\n..."``), then sentences continuing the paragraph (``" ..."``) until the next heading.
    """
    _check_count(seed, "seed")
    _check_count(count, "count")
    stream = _stream(seed, language, domain)
    stream.extend(count)
    return stream.units[:count]


# --------------------------------------------------------------------------------------------------------
# The gap-closing pool

#: Length classes of pool sentences, in English words (Chinese: the same shapes, so roughly 2x in characters).
_POOL_CLASSES = ("short", "brief", "standard", "extended", "long")


def _pool_sentence(v: _Vocabulary, language: str, rng: SplitMix64, klass: str) -> str:
    if klass == "short":  # 2-4 words: "Forms are online."
        subject, predicate = rng.choice(v.short_subjects), rng.choice(v.short_predicates)
        return f"{subject}{predicate}" if language == "zh" else f"{subject} {predicate}"
    if klass == "brief":  # 5-8 words: "Payroll staff must log archive boxes."
        return _template_sentence(v, language, rng, timing=False)
    if klass == "standard":  # 8-16 words: the filler template
        return _template_sentence(v, language, rng)
    if klass == "extended":  # 15-24 words: the template and a purpose
        first = _template_sentence(v, language, rng)[:-1]
        benefit = rng.choice(v.benefits)
        return f"{first}，以便{benefit}。" if language == "zh" else f"{first}, so that {benefit}."
    # long, 25-38 words: two template clauses (the second without a timing) and a purpose
    first = _template_sentence(v, language, rng)[:-1]
    second = _clause(v, language, rng)
    benefit = rng.choice(v.benefits)
    if language == "zh":
        return f"{first}，同时{second}，以便{benefit}。"
    return f"{first}, and {second}, so that {benefit}."


def filler_pool(
    seed: int, language: Literal["en", "zh"] | str, size: int, *, domain: str = "operations"
) -> list[str]:
    """``size`` distinct single-sentence units (each ``" "``-prefixed) of spread lengths.

    The layout engine uses them to close the gap to an exact token count: lengths run from very short
    (2-4 words, " Forms are online.") to long (about 35 words). Units cycle through the length classes
    short, brief, standard, extended, long; ``filler_pool(s, l, n)`` is a prefix of
    ``filler_pool(s, l, n + k)``.
    """
    _check_count(seed, "seed")
    _check_count(size, "size")
    vocabulary = _vocabulary(language, domain)
    rng = SplitMix64("depthgate/filler/pool/v1", domain, language, seed)
    pool: list[str] = []
    seen: set[str] = set()
    index = 0
    while len(pool) < size:
        klass = _POOL_CLASSES[index % len(_POOL_CLASSES)]
        index += 1
        for attempt in range(64):
            # a class whose distinct sentences run out (short has 240) falls back to the next one
            current = klass if attempt < 48 else _POOL_CLASSES[min(_POOL_CLASSES.index(klass) + 1, 4)]
            sentence = _pool_sentence(vocabulary, language, rng, current)
            if sentence not in seen:
                seen.add(sentence)
                pool.append(" " + sentence)
                break
    return pool


__all__ = ["DOMAINS", "SplitMix64", "filler_pool", "filler_units"]
