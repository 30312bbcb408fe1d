#!/usr/bin/env bash
# Sourced by the GPU scripts that start servers: wait for one to come up, stop one.

wait_up() {  # url pid seconds: 0 once GET url/health answers, 1 if the process exits or the time runs out
  for _ in $(seq 1 "$3"); do
    curl -sf "$1/health" > /dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

stop() {  # pid: SIGTERM (the server drains), SIGKILL after 15 s
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 1 30); do kill -0 "$1" 2>/dev/null || return 0; sleep 0.5; done
  kill -KILL "$1" 2>/dev/null
}
