#!/usr/bin/env bash
# Makes sure PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379) answer;
# starts them the way this machine kind does if they are installed but down,
# and fails loudly otherwise.
set -uo pipefail

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for() {
  local port=$1 name=$2
  for _ in $(seq 1 30); do
    answers "$port" && { echo "$name answers on 127.0.0.1:$port"; return 0; }
    sleep 1
  done
  echo "FATAL: $name does not answer on 127.0.0.1:$port" >&2
  return 1
}

if ! answers 5432; then
  echo "PostgreSQL is down; starting it"
  if command -v pg_ctlcluster >/dev/null 2>&1 && [ -d /etc/postgresql ]; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  fi
fi
wait_for 5432 PostgreSQL || exit 1
if command -v psql >/dev/null 2>&1; then
  psql -h 127.0.0.1 -U postgres -d test -Atc 'select 1' >/dev/null \
    || { echo "FATAL: PostgreSQL answers but database 'test' (user postgres, trust) is not usable" >&2; exit 1; }
  echo "PostgreSQL database 'test' is usable"
fi

if ! answers 6379; then
  echo "Redis is down; starting it"
  if command -v redis-server >/dev/null 2>&1; then
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
  fi
fi
wait_for 6379 Redis || exit 1
