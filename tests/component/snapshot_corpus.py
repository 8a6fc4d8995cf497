"""Realistic agent sessions for the snapshot fidelity test (``test_snapshot.py``).

Each session is what an agent typically does in a notebook: load, clean, aggregate,
plot, write helpers and classes, and leave awkward objects behind. After the cells run
in kernel A, the snapshot is restored in a fresh kernel B, and every ``checks`` entry
(a variable and an expression that must be True in B) is evaluated there. Variables in
``skipped`` cannot travel; the test requires them named in the capture's ``skipped``
with a reason containing the given text. Every variable a session leaves behind must be
listed in one or the other, so a silent loss cannot hide.

Cells run with the workspace (``KERNELHUB_WORKSPACE``) as the working directory, as in a
sandbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Session:
    name: str
    cells: list[str]
    checks: dict[str, str]
    skipped: dict[str, str] = field(default_factory=dict)


SESSIONS = [
    Session(
        name="sales_analysis",
        cells=[
            "import numpy as np\nimport pandas as pd\nimport matplotlib.pyplot as plt\nfrom pathlib import Path",
            # load
            "rng = np.random.default_rng(7)\n"
            "n = 5000\n"
            "raw = pd.DataFrame({\n"
            "    'order_id': np.arange(n),\n"
            "    'region': rng.choice(['north', 'south', 'east', 'west', None], n),\n"
            "    'amount': rng.gamma(2.0, 50.0, n).round(2),\n"
            "    'qty': rng.integers(1, 10, n),\n"
            "    'day': pd.date_range('2024-01-01', periods=n, freq='h'),\n"
            "})\n"
            "raw.to_csv('sales.csv', index=False)\n"
            "sales = pd.read_csv('sales.csv', parse_dates=['day'])",
            # clean
            "clean = sales.dropna(subset=['region']).copy()\n"
            "clean['region'] = clean['region'].astype('category')\n"
            "clean['unit_price'] = clean['amount'] / clean['qty']\n"
            "n_dropped = len(sales) - len(clean)",
            # aggregate
            "by_region = clean.groupby('region', observed=True).agg(total=('amount', 'sum'), orders=('order_id', 'count'))\n"
            "monthly = clean.set_index('day').resample('MS')['amount'].sum()\n"
            "pivot = clean.pivot_table(index=clean['day'].dt.month, columns='region', values='amount', aggfunc='sum', observed=True)\n"
            "top5 = clean.nlargest(5, 'amount')\n"
            "top_rows = [row for _, row in top5.iterrows()]",
            # plot
            "fig, ax = plt.subplots(figsize=(6, 3))\n"
            "bars = ax.bar(by_region.index.astype(str), by_region['total'])\n"
            "ax.set_title('Revenue by region')\n"
            "plt.close(fig)",
            # helpers
            "def share(frame, col='total'):\n"
            "    return (frame[col] / frame[col].sum()).round(4)\n"
            "shares = share(by_region)\n"
            "report = {'rows': len(clean), 'dropped': n_dropped, 'best': shares.idxmax(), 'frames': [by_region, pivot]}",
        ],
        checks={
            "rng": "isinstance(rng, np.random.Generator)",
            "n": "n == 5000",
            "raw": "raw.shape == (5000, 5) and raw['day'].dtype.kind == 'M'",
            "sales": "sales.shape == (5000, 5) and list(sales.columns) == list(raw.columns)",
            "clean": "str(clean['region'].dtype) == 'category' and abs(clean['unit_price'].sum() - (clean['amount'] / clean['qty']).sum()) < 1e-6",
            "n_dropped": "n_dropped == len(sales) - len(clean) and n_dropped > 0",
            "by_region": "list(by_region.columns) == ['total', 'orders'] and by_region['orders'].sum() == len(clean)",
            "monthly": "monthly.index.freqstr == 'MS' and abs(monthly.sum() - clean['amount'].sum()) < 1e-6",
            "pivot": "pivot.shape[1] == 4",
            "top5": "len(top5) == 5 and top5['amount'].is_monotonic_decreasing",
            "top_rows": "[r['order_id'] for r in top_rows] == list(top5['order_id'])",
            "fig": "fig.get_size_inches().tolist() == [6.0, 3.0]",
            "ax": "ax.figure is fig and ax.get_title() == 'Revenue by region'",
            "bars": "bars[0].axes is ax and len(bars) == 4",
            "share": "share(by_region).equals(shares)",
            "shares": "abs(shares.sum() - 1) < 1e-3",
            "report": "report['frames'][0] is by_region and report['frames'][1] is pivot and report['rows'] == len(clean)",
        },
    ),
    Session(
        name="ml_experiments",
        cells=[
            "import numpy as np\nfrom dataclasses import dataclass, field\nimport math",
            "rng = np.random.default_rng(0)\n"
            "X = rng.normal(size=(2000, 5)).astype(np.float32)\n"
            "w_true = np.array([1.5, -2.0, 0.0, 0.5, 3.0], dtype=np.float32)\n"
            "y = X @ w_true + rng.normal(scale=0.1, size=2000).astype(np.float32)\n"
            "split = 1500\n"
            "X_train, X_test = X[:split], X[split:]\n"
            "y_train, y_test = y[:split], y[split:]",
            "class LinearModel:\n"
            "    def __init__(self, l2=0.0):\n"
            "        self.l2 = l2\n"
            "        self.coef_ = None\n"
            "    def fit(self, X, y):\n"
            "        A = X.T @ X + self.l2 * np.eye(X.shape[1])\n"
            "        self.coef_ = np.linalg.solve(A, X.T @ y)\n"
            "        return self\n"
            "    def predict(self, X):\n"
            "        return X @ self.coef_\n"
            "def rmse(a, b):\n"
            "    return float(math.sqrt(((a - b) ** 2).mean()))",
            "@dataclass(frozen=True)\n"
            "class Run:\n"
            "    l2: float\n"
            "    score: float\n"
            "    tags: tuple = ()\n"
            "runs = []\n"
            "models = {}\n"
            "for l2 in [0.0, 0.1, 1.0, 10.0]:\n"
            "    m = LinearModel(l2).fit(X_train, y_train)\n"
            "    models[l2] = m\n"
            "    runs.append(Run(l2, rmse(m.predict(X_test), y_test), ('ridge',)))\n"
            "best = min(runs, key=lambda r: r.score)\n"
            "best_model = models[best.l2]",
            "score_of = lambda run: round(run.score, 4)\n"
            "def make_counter():\n"
            "    calls = []\n"
            "    def count(tag):\n"
            "        calls.append(tag)\n"
            "        return len(calls)\n"
            "    return count, calls\n"
            "count, calls = make_counter()\n"
            "count('a'); count('b')\n"
            "@dataclass\n"
            "class Config:\n"
            "    epochs: int = 3\n"
            "    layers: list = field(default_factory=lambda: [64, 32])\n"
            "cfg = Config()\n"
            "history = {'loss': [0.9, 0.5, 0.3], 'cfg': cfg}",
        ],
        checks={
            "rng": "isinstance(rng, np.random.Generator)",
            "X": "X.dtype == np.float32 and X.shape == (2000, 5)",
            "w_true": "w_true.tolist() == [1.5, -2.0, 0.0, 0.5, 3.0]",
            "y": "y.shape == (2000,) and y.dtype == np.float32",
            "split": "split == 1500",
            "X_train": "np.array_equal(X_train, X[:1500])",
            "X_test": "np.array_equal(X_test, X[1500:])",
            "y_train": "np.array_equal(y_train, y[:1500])",
            "y_test": "np.array_equal(y_test, y[1500:])",
            "LinearModel": "LinearModel(1.0).fit(X_train, y_train).coef_.shape == (5,)",
            "rmse": "rmse(np.zeros(3), np.zeros(3)) == 0.0",
            "Run": "Run(1.0, 2.0).score == 2.0 and Run.__dataclass_params__.frozen",
            "runs": "len(runs) == 4 and all(isinstance(r, Run) for r in runs)",
            "models": "all(isinstance(m, LinearModel) for m in models.values())",
            "m": "m is models[10.0]",
            "l2": "l2 == 10.0",
            "best": "best in runs and best is min(runs, key=lambda r: r.score)",
            "best_model": "best_model is models[best.l2] and rmse(best_model.predict(X_test), y_test) == best.score",
            "score_of": "score_of(best) == round(best.score, 4)",
            "make_counter": "make_counter()[0]('x') == 1",
            "count": "count('c') == 3 and calls == ['a', 'b', 'c']",
            "calls": "calls is count.__closure__[0].cell_contents",
            "Config": "Config().layers == [64, 32]",
            "cfg": "isinstance(cfg, Config) and cfg.epochs == 3",
            "history": "history['cfg'] is cfg and history['loss'][-1] == 0.3",
        },
    ),
    Session(
        name="text_processing",
        cells=[
            "import re\nfrom collections import Counter, defaultdict, OrderedDict, deque\nimport string",
            "docs = [\n"
            "    'The quick brown fox jumps over the lazy dog.',\n"
            "    'Never jump over the lazy dog quickly!',\n"
            "    'Brown foxes are quick; dogs are lazy.',\n"
            "]\n"
            'WORD = re.compile(r"[a-z\']+")\n'
            "def tokenize(text):\n"
            "    return WORD.findall(text.lower())\n"
            "tokens = [tokenize(d) for d in docs]\n"
            "vocab = Counter(t for doc in tokens for t in doc)",
            "index = defaultdict(set)\n"
            "for i, doc in enumerate(tokens):\n"
            "    for t in doc:\n"
            "        index[t].add(i)\n"
            "stop = {'the', 'over', 'are'}\n"
            "content = {w: c for w, c in vocab.items() if w not in stop}\n"
            "ranked = sorted(content.items(), key=lambda kv: (-kv[1], kv[0]))\n"
            "recent = deque(maxlen=3)\n"
            "for d in docs:\n"
            "    recent.append(d[:10])\n"
            "table = str.maketrans('', '', string.punctuation)\n"
            "cleaned = [d.translate(table) for d in docs]",
            "m = WORD.search('Hello there')\n"
            "lines = (d.upper() for d in docs)\n"
            "ordered = OrderedDict(ranked[:3])\n"
            "bigrams = Counter(zip(tokens[0], tokens[0][1:]))\n"
            "summary = f'{len(docs)} docs, {len(vocab)} words'",
        ],
        checks={
            "docs": "len(docs) == 3 and docs[0].startswith('The quick')",
            "WORD": 'WORD.pattern == "[a-z\']+"',
            "tokenize": "tokenize('A b') == ['a', 'b']",
            "tokens": "tokens[1][0] == 'never'",
            "vocab": "vocab['lazy'] == 3 and isinstance(vocab, Counter)",
            "index": "index['lazy'] == {0, 1, 2} and index.default_factory is set and len(index['zzz']) == 0",
            "i": "i == 2",
            "doc": "doc is tokens[2]",
            "t": "t == 'lazy'",
            "stop": "stop == {'the', 'over', 'are'}",
            "content": "'the' not in content and content['lazy'] == 3",
            "ranked": "ranked[0] == ('lazy', 3)",
            "recent": "recent.maxlen == 3 and list(recent) == [d[:10] for d in docs]",
            "d": "d == docs[-1]",
            "table": "'a.'.translate(table) == 'a'",
            "cleaned": "cleaned[0].endswith('dog')",
            "ordered": "list(ordered) == [k for k, _ in ranked[:3]] and isinstance(ordered, OrderedDict)",
            "bigrams": "bigrams[('the', 'quick')] == 1",
            "summary": "summary.startswith('3 docs')",
        },
        skipped={"m": "match object", "lines": "generator"},
    ),
    Session(
        name="timeseries",
        cells=[
            "import numpy as np\nimport pandas as pd\nimport enum",
            "idx = pd.date_range('2024-03-01', periods=24 * 14, freq='h', tz='Europe/Paris')\n"
            "load = pd.Series(np.sin(np.arange(len(idx)) / 6.0) * 10 + 50, index=idx, name='load')\n"
            "daily = load.resample('D').agg(['mean', 'max'])\n"
            "smooth = load.rolling(6, min_periods=1).mean()\n"
            "readings = pd.DataFrame({\n"
            "    'sensor': pd.Categorical(['a', 'b', 'a', 'c']),\n"
            "    'value': pd.array([1, None, 3, 4], dtype='Int64'),\n"
            "    'period': pd.period_range('2024-01', periods=4, freq='M'),\n"
            "    'lag': pd.to_timedelta([1, 2, 3, 4], unit='min'),\n"
            "})\n"
            "multi = readings.set_index(['sensor', 'period'])",
            "class Freq(enum.Enum):\n"
            "    HOURLY = 'h'\n"
            "    DAILY = 'D'\n"
            "    def resample(self, s):\n"
            "        return s.resample(self.value).mean()\n"
            "class Level(enum.IntEnum):\n"
            "    LOW = 1\n"
            "    HIGH = 2\n"
            "class Perm(enum.Flag):\n"
            "    R = enum.auto()\n"
            "    W = enum.auto()\n"
            "    X = enum.auto()\n"
            "rw = Perm.R | Perm.W\n"
            "handlers = {Freq.HOURLY: len, Freq.DAILY: lambda s: s.max()}\n"
            "chosen = Freq.DAILY\n"
            "levels = [Level.HIGH, Level.LOW]",
            "peak = load.idxmax()\n"
            "window = (idx[0], idx[-1])\n"
            "gap = idx[1] - idx[0]\n"
            "stamps = {'start': pd.Timestamp('2024-03-01', tz='UTC'), 'missing': pd.NaT, 'na': pd.NA}",
        ],
        checks={
            "idx": "str(idx.tz) == 'Europe/Paris' and len(idx) == 336 and idx.freqstr == 'h'",
            "load": "load.index.equals(idx) and load.name == 'load'",
            "daily": "list(daily.columns) == ['mean', 'max'] and len(daily) == 14",
            "smooth": "len(smooth) == 336 and abs(smooth.iloc[0] - load.iloc[0]) < 1e-9",
            "readings": "str(readings['value'].dtype) == 'Int64' and readings['value'].isna().sum() == 1 and str(readings['period'].dtype) == 'period[M]' and readings['lag'].dtype.kind == 'm'",
            "multi": "multi.index.nlevels == 2 and multi.index.names == ['sensor', 'period']",
            "Freq": "Freq('h') is Freq.HOURLY and len(Freq.DAILY.resample(load)) == 14",
            "Level": "Level.HIGH > Level.LOW and Level(2) is Level.HIGH",
            "Perm": "Perm.X not in (Perm.R | Perm.W)",
            "rw": "rw == (Perm.R | Perm.W) and Perm.R in rw",
            "handlers": "handlers[Freq.HOURLY] is len and handlers[chosen](load) == load.max()",
            "chosen": "chosen is Freq.DAILY",
            "levels": "levels[0] is Level.HIGH and isinstance(levels[1], Level)",
            "peak": "peak == load.idxmax()",
            "window": "window == (idx[0], idx[-1])",
            "gap": "gap == pd.Timedelta(hours=1)",
            "stamps": "stamps['missing'] is pd.NaT and stamps['na'] is pd.NA and stamps['start'].tz is not None",
        },
    ),
    Session(
        name="plotting",
        cells=[
            "import numpy as np\nimport matplotlib.pyplot as plt",
            "x = np.linspace(0, 10, 200)\n"
            "fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(8, 3))\n"
            "lines = ax1.plot(x, np.sin(x), x, np.cos(x))\n"
            "ax1.legend(['sin', 'cos'])\n"
            "img = ax2.imshow(np.outer(np.sin(x[:20]), np.cos(x[:20])), cmap='viridis')\n"
            "cbar = fig.colorbar(img, ax=ax2)\n"
            "note = ax1.annotate('peak', xy=(np.pi / 2, 1))\n"
            "plt.close(fig)",
            "grid, axs = plt.subplots(2, 2, sharex=True)\n"
            "for k, a in enumerate(axs.flat):\n"
            "    a.hist(np.random.default_rng(k).normal(size=100), bins=10)\n"
            "grid.suptitle('grid')\n"
            "plt.close(grid)\n"
            "palette = {'sin': lines[0].get_color(), 'cos': lines[1].get_color()}\n"
            "styles = [dict(lw=1), dict(lw=2, ls='--')]",
        ],
        checks={
            "x": "x.shape == (200,)",
            "fig": "len(fig.axes) == 3",
            "ax1": "ax1.figure is fig and ax1 in fig.axes",
            "ax2": "ax2.figure is fig and img in ax2.images",
            "lines": "lines[0].axes is ax1 and len(ax1.lines) == 2 and lines[1] is ax1.lines[1]",
            "img": "img.get_cmap().name == 'viridis'",
            "cbar": "cbar.mappable is img",
            "note": "note.axes is ax1 and note.get_text() == 'peak'",
            "grid": "grid._suptitle.get_text() == 'grid'",
            "axs": "axs.shape == (2, 2) and all(a.figure is grid for a in axs.flat)",
            "k": "k == 3",
            "a": "a is axs.flat[3]",
            "palette": "palette['sin'] == lines[0].get_color()",
            "styles": "styles[1]['ls'] == '--'",
        },
    ),
    Session(
        name="awkward_objects",
        cells=[
            "import logging, threading, queue, socket, sqlite3, hashlib, functools, sys, types, io\n"
            "import concurrent.futures as cf\n"
            "from decimal import Decimal\nfrom fractions import Fraction\nimport datetime as dt, uuid, pathlib",
            "log = logging.getLogger('agent.session')\n"
            "log.setLevel(logging.INFO)\n"
            "log.propagate = False\n"
            "stream_handler = logging.StreamHandler(sys.stdout)\n"
            "stream_handler.setFormatter(logging.Formatter('%(levelname)s:%(message)s'))\n"
            "log.addHandler(stream_handler)\n"
            "file_handler = logging.FileHandler('agent.log')\n"
            "log.addHandler(file_handler)\n"
            "log.info('started')",
            "with open('notes.txt', 'w') as f:\n"
            "    f.write('alpha\\nbeta\\ngamma\\n')\n"
            "reader = open('notes.txt')\n"
            "first = reader.readline()\n"
            "appender = open('journal.txt', 'a')\n"
            "appender.write('entry 1\\n')\n"
            "blob = open('notes.txt', 'rb')\n"
            "head = blob.read(3)",
            "guard = threading.RLock()\n"
            "guard.acquire()\n"
            "mutex = threading.Lock()\n"
            "ready = threading.Event()\n"
            "ready.set()\n"
            "jobs = queue.Queue()\n"
            "jobs.put('a'); jobs.put('b')\n"
            "conn = sqlite3.connect(':memory:')\n"
            "sock = socket.socket()\n"
            "worker = threading.Thread(target=lambda: None)\n"
            "pool = cf.ThreadPoolExecutor(max_workers=1)\n"
            "digest = hashlib.md5(b'abc')\n"
            "out = sys.stdout",
            "def scale(x, factor):\n"
            "    return x * factor\n"
            "double = functools.partial(scale, factor=2)\n"
            "@functools.lru_cache(maxsize=16)\n"
            "def fib(k):\n"
            "    return k if k < 2 else fib(k - 1) + fib(k - 2)\n"
            "fib(20)\n"
            "ns = types.SimpleNamespace(a=1, b=[1, 2])\n"
            "money = Decimal('10.25')\n"
            "ratio = Fraction(3, 7)\n"
            "when = dt.datetime(2024, 5, 17, 12, 30, tzinfo=dt.timezone.utc)\n"
            "ident = uuid.UUID('12345678123456781234567812345678')\n"
            "where = pathlib.Path('data') / 'x.csv'",
        ],
        checks={
            "log": "log.level == logging.INFO and not log.propagate and len(log.handlers) == 2 and log is logging.getLogger('agent.session')",
            "stream_handler": "stream_handler in log.handlers and stream_handler.stream is sys.stdout",
            "file_handler": "file_handler in log.handlers and file_handler.baseFilename.endswith('agent.log') and file_handler.stream is not None",
            "f": "f.closed and f.name == 'notes.txt' and f.mode == 'w'",
            "reader": "reader.mode == 'r' and reader.tell() == 6 and reader.readline() == 'beta\\n'",
            "first": "first == 'alpha\\n'",
            "appender": "appender.mode == 'a' and (appender.write('entry 2\\n') or appender.flush() or open('journal.txt').read() == 'entry 1\\nentry 2\\n')",
            "blob": "blob.mode == 'rb' and blob.read(2) == b'ha'",
            "head": "head == b'alp'",
            "guard": "guard._is_owned()",
            "mutex": "not mutex.locked()",
            "ready": "ready.is_set()",
            "jobs": "jobs.qsize() == 2 and jobs.get_nowait() == 'a'",
            "out": "out is sys.stdout",
            "scale": "scale(2, 3) == 6",
            "double": "double(21) == 42",
            "fib": "fib(30) == 832040 and fib.cache_info().maxsize == 16",
            "ns": "ns.a == 1 and ns.b == [1, 2]",
            "money": "money == Decimal('10.25')",
            "ratio": "ratio == Fraction(3, 7)",
            "when": "when.tzinfo is dt.timezone.utc and when.hour == 12",
            "ident": "ident.hex == '12345678123456781234567812345678'",
            "where": "where == pathlib.Path('data/x.csv')",
        },
        skipped={
            "conn": "database connection",
            "sock": "socket",
            "worker": "thread",
            "pool": "executor",
            "digest": "hash object",
        },
    ),
    Session(
        name="classes_and_helpers",
        cells=[
            "import abc\nfrom typing import NamedTuple\nfrom dataclasses import dataclass, field\nimport functools",
            "class Shape(abc.ABC):\n"
            "    registry = []\n"
            "    def __init_subclass__(cls, **kw):\n"
            "        super().__init_subclass__(**kw)\n"
            "        Shape.registry.append(cls.__name__)\n"
            "    @abc.abstractmethod\n"
            "    def area(self): ...\n"
            "    def describe(self):\n"
            "        return f'{type(self).__name__} with area {self.area():.2f}'\n"
            "class Rect(Shape):\n"
            "    def __init__(self, w, h):\n"
            "        self.w, self.h = w, h\n"
            "    def area(self):\n"
            "        return self.w * self.h\n"
            "    @property\n"
            "    def is_square(self):\n"
            "        return self.w == self.h\n"
            "    @classmethod\n"
            "    def square(cls, s):\n"
            "        return cls(s, s)\n"
            "    @staticmethod\n"
            "    def unit():\n"
            "        return Rect(1, 1)\n"
            "class Square(Rect):\n"
            "    def __init__(self, s):\n"
            "        super().__init__(s, s)\n"
            "    def describe(self):\n"
            "        return 'square: ' + super().describe()",
            "class Point(NamedTuple):\n"
            "    x: float\n"
            "    y: float\n"
            "class Slotted:\n"
            "    __slots__ = ('a', 'b')\n"
            "    def __init__(self, a, b):\n"
            "        self.a, self.b = a, b\n"
            "class Positive:\n"
            "    def __set_name__(self, owner, name):\n"
            "        self.name = '_' + name\n"
            "    def __get__(self, obj, objtype=None):\n"
            "        return getattr(obj, self.name)\n"
            "    def __set__(self, obj, value):\n"
            "        if value <= 0:\n"
            "            raise ValueError(value)\n"
            "        setattr(obj, self.name, value)\n"
            "class Account:\n"
            "    balance = Positive()\n"
            "    def __init__(self, b):\n"
            "        self.balance = b\n"
            "class Meta(type):\n"
            "    def __new__(mcls, name, bases, ns):\n"
            "        ns['tag'] = name.lower()\n"
            "        return super().__new__(mcls, name, bases, ns)\n"
            "class Tagged(metaclass=Meta):\n"
            "    pass\n"
            "@dataclass(order=True)\n"
            "class Task:\n"
            "    priority: int\n"
            "    name: str = field(compare=False)\n"
            "    deps: list = field(default_factory=list, compare=False)",
            "shapes = [Rect(2, 3), Square(2), Rect.square(4)]\n"
            "biggest = max(shapes, key=lambda s: s.area())\n"
            "p = Point(1.5, 2.5)\n"
            "s = Slotted(1, [2])\n"
            "acct = Account(10)\n"
            "t = Tagged()\n"
            "a_task = Task(2, 'build')\n"
            "tasks = sorted([Task(3, 'test', [a_task]), a_task, Task(1, 'plan')])\n"
            "tables = {'a': [1, 2], 'b': [3]}\n"
            "tab = tables['a']\n"
            "def compose(*fs):\n"
            "    return functools.reduce(lambda f, g: lambda x: g(f(x)), fs)\n"
            "inc_then_double = compose(lambda x: x + 1, lambda x: x * 2)",
        ],
        checks={
            "Shape": "Shape.registry == ['Rect', 'Square'] and issubclass(Square, Shape)",
            "Rect": "Rect.unit().area() == 1 and Rect.square(3).is_square",
            "Square": "Square(3).describe() == 'square: Square with area 9.00'",
            "Point": "Point(1, 2)._asdict() == {'x': 1, 'y': 2}",
            "Slotted": "not hasattr(Slotted(1, 2), '__dict__')",
            "Positive": "isinstance(Account.__dict__['balance'], Positive)",
            "Account": "Account(5).balance == 5",
            "Meta": "type(Tagged) is Meta",
            "Tagged": "Tagged.tag == 'tagged'",
            "Task": "Task(1, 'x') < Task(2, 'y')",
            "shapes": "all(isinstance(x, Shape) for x in shapes) and type(shapes[1]) is Square",
            "biggest": "biggest is shapes[2] and biggest.area() == 16",
            "p": "isinstance(p, Point) and p.x == 1.5",
            "s": "isinstance(s, Slotted) and s.b == [2]",
            "acct": "acct.balance == 10 and isinstance(acct, Account)",
            "t": "isinstance(t, Tagged)",
            "a_task": "a_task in tasks and tasks[2].deps[0] is a_task",
            "tasks": "[x.priority for x in tasks] == [1, 2, 3]",
            "tables": "tables['b'] == [3]",
            "tab": "tab is tables['a']",
            "compose": "compose(lambda x: x - 1)(5) == 4",
            "inc_then_double": "inc_then_double(3) == 8",
        },
    ),
    Session(
        name="json_and_records",
        cells=[
            "import json\nimport pandas as pd\nfrom urllib.parse import urlparse, parse_qs\nimport xml.etree.ElementTree as ET\nfrom datetime import datetime",
            'payload = json.loads(\'\'\'{"users": [{"id": 1, "name": "Ada", "tags": ["x"], "address": {"city": "Paris"}},\n'
            '  {"id": 2, "name": "Linus", "tags": [], "address": {"city": "Helsinki"}}], "next": "https://api.example.com/users?page=2&size=50"}\'\'\')\n'
            "users = payload['users']\n"
            "flat = pd.json_normalize(users)\n"
            "by_id = {u['id']: u for u in users}\n"
            "nxt = urlparse(payload['next'])\n"
            "query = parse_qs(nxt.query)",
            'root = ET.fromstring(\'<feed><item id="1">a</item><item id="2">b</item></feed>\')\n'
            "items = [(el.get('id'), el.text) for el in root]\n"
            "fetched_at = datetime(2024, 6, 1, 8, 0)\n"
            "cache = {'users': users, 'when': fetched_at}\n"
            "with open('users.json', 'w') as fh:\n"
            "    json.dump(payload, fh)\n"
            "size = len(json.dumps(payload))",
        ],
        checks={
            "payload": "payload['users'][0]['address']['city'] == 'Paris'",
            "users": "users is payload['users']",
            "flat": "'address.city' in flat.columns and len(flat) == 2",
            "by_id": "by_id[2] is users[1]",
            "nxt": "nxt.netloc == 'api.example.com'",
            "query": "query == {'page': ['2'], 'size': ['50']}",
            "root": "root.tag == 'feed' and len(root) == 2",
            "items": "items == [('1', 'a'), ('2', 'b')]",
            "fetched_at": "fetched_at.year == 2024",
            "cache": "cache['users'] is users and cache['when'] == fetched_at",
            "fh": "fh.closed and fh.name == 'users.json'",
            "size": "size == len(json.dumps(payload))",
        },
    ),
]
