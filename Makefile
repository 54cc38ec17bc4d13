# mtaq - two commands do all the set-up on a fresh machine:
#   make run    creates .venv, installs, starts the local sink and the daemon on the embedded default
#   make test   installs what the tests need (Python packages, Debian packages) and runs the whole suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
LISTEN ?= 127.0.0.1:2525
SINK_HOST ?= 127.0.0.1
SINK_PORT ?= 2526

.PHONY: install install-service debs native run test lint bench bench-analytics spark-zip compare compare-backlog compare-all clean-spool

$(STAMP): pyproject.toml setup.py mtaq/analytics/_segment.c mtaq/core/_octets.c
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,spark,spark-connect]'
	touch $(STAMP)

# Started as root, mtaq serve runs as mail_owner (default mtaq): the system user is created when missing.
# mtaq's bytecode is compiled as an installed package's is (pip compiles a wheel's; an editable install's is
# written at first import only where PYTHONDONTWRITEBYTECODE is unset and the tree writable): without it every
# start compiles mtaq from source, about 0.3 s more to the first 250 (docs/performance.md, "Stop 60").
MAIL_OWNER ?= mtaq
install: $(STAMP)
	@$(BIN)/python -m compileall -q mtaq >/dev/null
	@if [ "$$(id -u)" = 0 ] && ! getent passwd $(MAIL_OWNER) >/dev/null; then \
	  useradd --system --no-create-home --shell /usr/sbin/nologin $(MAIL_OWNER); fi

# On a host, as root: the systemd service (contrib/systemd/mtaq.service; README "Install on a host"). mtaq goes
# into its own virtual environment SERVICE_PREFIX (/opt/mtaq: readable by the mtaq user, which a checkout
# under /root, mode 0700, is not; umask 022 for it), made and filled by pip unless it has an mtaq already; the unit into
# /etc/systemd/system; /etc/mtaq/mtaq.toml only when there is none; /usr/sbin/sendmail only when there is
# none. DESTDIR stages it all under another root (tests/test_systemd_unit.py); systemctl runs only when
# systemd is PID 1 (/run/systemd/system exists, as sd_booted(3) checks) and DESTDIR is empty.
SERVICE_PREFIX ?= /opt/mtaq
DESTDIR ?=
install-service:
	@test "$$(id -u)" = 0 || { echo "make install-service: run as root" >&2; exit 1; }
	getent passwd $(MAIL_OWNER) >/dev/null || useradd --system --no-create-home --shell /usr/sbin/nologin $(MAIL_OWNER)
	test -x $(DESTDIR)$(SERVICE_PREFIX)/bin/mtaq || { umask 022 && $(PY) -m venv $(DESTDIR)$(SERVICE_PREFIX) && \
	  $(DESTDIR)$(SERVICE_PREFIX)/bin/pip install -q . ; }
	install -D -m 0644 contrib/systemd/mtaq.service $(DESTDIR)/etc/systemd/system/mtaq.service
	install -d -m 0755 $(DESTDIR)/etc/mtaq
	test -e $(DESTDIR)/etc/mtaq/mtaq.toml || install -m 0644 contrib/systemd/mtaq.toml $(DESTDIR)/etc/mtaq/mtaq.toml
	install -d -m 0755 $(DESTDIR)/usr/sbin
	test -e $(DESTDIR)/usr/sbin/sendmail || test -L $(DESTDIR)/usr/sbin/sendmail || \
	  ln -s $(SERVICE_PREFIX)/bin/mtaq $(DESTDIR)/usr/sbin/sendmail
	if [ -z "$(DESTDIR)" ] && [ -d /run/systemd/system ]; then systemctl daemon-reload && systemctl enable --now mtaq; \
	else echo "make install-service: systemd is not PID 1 here (or DESTDIR is set): not started"; fi

# Debian packages used by tests that talk to real tools, as command:package (swaks as an SMTP client,
# nmap's smtp-open-relay, libfiu's fiu-run/fiu-ctrl for fsync EIO injection, chromium to look at the
# analytics report.html headless, pflogsumm for bench/analytics.py --pflogsumm, systemd-analyze to check
# contrib/systemd/mtaq.service, rspamd and opendkim as the real milters of mtaq.testing.filters; both
# packages enable a system service, which the tests never use: theirs run on free ports in a temporary directory;
# gcc and libmilter-dev (a header, no command: checked by file) build bench/noop_milter.c, the benchmarks' filter;
# gcc and python3-dev (Python.h) build mtaq/analytics/_segment.c, the analytics' frame walk in C, and
# mtaq/core/_octets.c, the relay's byte passes over a message's text: `make test` installs them before the
# package, so the tests run both (tests/test_analytics_native.py and tests/test_octets.py check they are built).
# iproute2: ss, which a workers test uses to name what holds a port.
DEBS := swaks:swaks nmap:nmap fiu-run:fiu-utils chromium:chromium pflogsumm:pflogsumm systemd-analyze:systemd \
	rspamd:rspamd opendkim:opendkim gcc:gcc ss:iproute2
DEB_FILES := /usr/include/libmilter/mfapi.h:libmilter-dev \
	$(shell $(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h:python3-dev
debs:
	@missing=""; for t in $(DEBS); do command -v $${t%%:*} >/dev/null 2>&1 || missing="$$missing $${t#*:}"; done; \
	for t in $(DEB_FILES); do test -e $${t%%:*} || missing="$$missing $${t#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; fi
	@command -v java >/dev/null 2>&1 || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null; }

run: install
	mkdir -p spool
	@echo "mtaq: SMTP on $(LISTEN), spool ./spool, next hop the sink on [$(SINK_HOST)]:$(SINK_PORT) (Maildir spool/sink/)"
	$(BIN)/mtaq sink --listen $(SINK_HOST):$(SINK_PORT) --maildir spool/sink & sink=$$!; \
	trap 'kill $$sink 2>/dev/null' EXIT INT TERM; \
	$(BIN)/mtaq serve --spool spool --listen $(LISTEN) --relayhost '[$(SINK_HOST)]:$(SINK_PORT)' || true

lint: install
	$(BIN)/ruff check mtaq bench tests
	$(BIN)/mypy mtaq

# The C module again where `make install` ran before gcc and Python's headers were there (make run first on a
# fresh machine): the stamp is then newer than its sources, but the module was skipped as optional.
native: debs $(STAMP)
	@$(BIN)/python -c 'import mtaq.analytics._segment, mtaq.core._octets' 2>/dev/null || \
	  $(BIN)/python -m pip install -q -e '.[test,spark,spark-connect]'

test: debs install native lint
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/python bench/throughput.py --messages 10000 --concurrency 20 --size 2048

bench-analytics: install debs
	$(BIN)/python bench/analytics.py --records 1000000 --pflogsumm --first-run --without-archive
	$(BIN)/python bench/analytics.py --records 10000000

# The module zip for spark-submit --py-files (executors import mtaq from it).
spark-zip:
	mkdir -p dist && $(PY) -c "import zipfile, pathlib; z = zipfile.ZipFile('dist/mtaq.zip', 'w'); \
	  [z.write(p) for e in ('py', 'toml') for p in sorted(pathlib.Path('mtaq').rglob('*.' + e))]; z.close()"

# mtaq against Postfix, issue 15's table in one run (root: installs and configures Postfix from Debian; perf
# counts fsyncs; gcc and libmilter-dev build the no-op filter of --milter; see docs/performance.md). JSON on
# stdout, the table on stderr.
compare: install
	@command -v perf >/dev/null 2>&1 || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq linux-perf >/dev/null || true; }
	@{ command -v gcc && test -e /usr/include/libmilter/mfapi.h; } >/dev/null 2>&1 || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq gcc libmilter-dev >/dev/null || true; }
	$(BIN)/python bench/compare_postfix.py --suite

# The backlog table (issue 36): drain, listing and the first 250 after kill -9 with N queued, against
# Postfix on the same N (root; about 15 minutes at 100,000). MESSAGES=100000,1000000 for both sizes.
MESSAGES ?= 100000
compare-backlog: install
	PYTHONPATH=$(CURDIR) $(BIN)/python bench/backlog.py --messages $(MESSAGES) --pairs 3

# Issue 36's two tables in one run: the steady state (compare), then the backlog (compare-backlog).
compare-all: compare compare-backlog

clean-spool:
	rm -rf spool/log spool/sink
