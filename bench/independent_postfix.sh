#!/bin/bash
# An independent cross-check of bench/compare_postfix.py (issue 15.1), sharing no code with it: Postfix as
# Debian's "Satellite system" sets it up (main.cf.debian + main.cf.tls + the satellite answers, relayhost
# the sink, nothing tuned, smtpd on port 25, logging to syslog as shipped), mtaq as `make run` starts it
# (`mtaq serve`, embedded defaults, --workers as given), Postfix's `smtp-sink -c` counting what arrives,
# `smtp-source` as the client, one connection per message. Runs alternate Postfix, mtaq.
#
# The end of a run is the moment the sink's counter reaches the message count (polled every 20 ms from
# the counter file); the rate is messages / (that moment - the start of smtp-source). Prints one line
# per run: side, messages/s end to end, messages/s accepted (smtp-source's wall time).
#
#   bash bench/independent_postfix.sh [SESSIONS] [MESSAGES] [SIZE] [PAIRS] [WORKERS]
# Needs root (rewrites /etc/postfix/main.cf): run it on a bench machine.
set -euo pipefail
S=${1:-20}; M=${2:-10000}; L=${3:-2048}; PAIRS=${4:-3}; W=${5:-1}
HERE=$(cd "$(dirname "$0")/.." && pwd)
MTAQ=${MTAQ:-$HERE/.venv/bin/mtaq}
SINK_PORT=2626; MTAQ_PORT=2625
command -v smtp-source >/dev/null || { echo "independent_postfix: install postfix first" >&2; exit 2; }

cat /usr/share/postfix/main.cf.debian /usr/share/postfix/main.cf.tls > /etc/postfix/main.cf
postconf -e myhostname=bench-satellite.localdomain 'alias_maps=hash:/etc/aliases' \
  'alias_database=hash:/etc/aliases' myorigin=/etc/mailname \
  'mydestination=$myhostname, localhost.localdomain, localhost' "relayhost=[127.0.0.1]:$SINK_PORT" \
  'mynetworks=127.0.0.0/8 [::ffff:127.0.0.0]/104 [::1]/128' mailbox_size_limit=0 recipient_delimiter=+ \
  inet_interfaces=loopback-only inet_protocols=all
echo bench-satellite.localdomain > /etc/mailname
touch /etc/aliases; newaliases
cp /usr/share/postfix/master.cf.dist /etc/postfix/master.cf
postfix status >/dev/null 2>&1 && postfix stop >/dev/null 2>&1 || true
postfix start >/dev/null 2>&1
sleep 1

now() { date +%s.%N; }
wait_count() {  # file count -> prints the time the count was seen
  while :; do
    c=$(tr '\r' '\n' < "$1" | tail -n 2 | grep -o 'mesg=[0-9]*' | tail -n 1 | cut -d= -f2)
    if [ "${c:-0}" -ge "$2" ]; then now; return; fi
    sleep 0.02
  done
}
one_run() {  # side port
  local out; out=$(mktemp)
  smtp-sink -c -u nobody 127.0.0.1:$SINK_PORT 1024 > "$out" & local sink=$!
  sleep 0.3
  local t0 t1 te; t0=$(now)
  smtp-source -s "$S" -m "$M" -l "$L" -f bench@source.example -t rcpt@dest.example 127.0.0.1:"$2"
  t1=$(now); te=$(wait_count "$out" "$M")
  kill "$sink"; wait "$sink" 2>/dev/null || true; rm -f "$out"
  python3 -c "import sys; m,t0,t1,te=map(float,sys.argv[1:5]); print(sys.argv[5], 'e2e %.1f msg/s accepted %.1f msg/s' % (m/(te-t0), m/(t1-t0)))" "$M" "$t0" "$t1" "$te" "$1"
}
for p in $(seq "$PAIRS"); do
  postsuper -d ALL >/dev/null 2>&1 || true
  one_run postfix 25
  spool=$(mktemp -d /var/tmp/mtaq-indep-XXXX)
  "$MTAQ" serve --spool "$spool" --listen 127.0.0.1:$MTAQ_PORT --relayhost "[127.0.0.1]:$SINK_PORT" \
    --workers "$W" > "$spool.log" 2>&1 & d=$!
  until (exec 3<>/dev/tcp/127.0.0.1/$MTAQ_PORT) 2>/dev/null; do sleep 0.05; done
  sleep 1
  one_run "mtaq-w$W" $MTAQ_PORT
  kill -9 "$d"; wait "$d" 2>/dev/null || true; rm -rf "$spool" "$spool.log"
done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
