# leash: build, test and benchmark entry points.
#
# Integration tests start their own redis-server processes on free loopback
# ports (see internal/testredis); they never use a system Redis on 6379. The
# only requirement is a redis-server binary on PATH, which the ensure-redis
# target installs when it can (as root, with apt-get).

GO ?= go

.PHONY: all test vet bench ensure-redis

all: test

# ensure-redis makes sure the redis-server binary is on PATH. As root it is
# installed with apt-get; the Debian package also enables and starts a
# system service on port 6379, which leash never uses, so that service is
# stopped and disabled again (failures to do so, e.g. in a container without
# systemd, are ignored). Without root it only says what to run.
ensure-redis:
	@if ! command -v redis-server >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then \
			echo "redis-server is missing: installing it with apt-get"; \
			export DEBIAN_FRONTEND=noninteractive; \
			apt-get update && apt-get install -y redis-server || exit 1; \
			{ systemctl disable --now redis-server.service || service redis-server stop || true; } >/dev/null 2>&1; \
			command -v redis-server >/dev/null 2>&1 || { echo "redis-server is still not on PATH after apt-get install" >&2; exit 1; }; \
		else \
			echo 'redis-server is missing: run "sudo apt-get install -y redis-server"' >&2; \
			exit 1; \
		fi; \
	fi

vet:
	$(GO) vet ./...
	@if [ -f bench/go.mod ]; then \
		echo "cd bench && $(GO) vet ./..."; \
		cd bench && $(GO) vet ./...; \
	fi

test: ensure-redis vet
	$(GO) test -race -count=1 -timeout 20m ./...
	@if [ -f bench/go.mod ]; then \
		echo "cd bench && $(GO) test -race -count=1 ./..."; \
		cd bench && $(GO) test -race -count=1 ./...; \
	fi

bench: ensure-redis
	@if [ -f bench/go.mod ]; then \
		echo "cd bench && $(GO) run . -out results"; \
		cd bench && $(GO) run . -out results; \
	else \
		echo "$(GO) run ./bench -out bench/results"; \
		$(GO) run ./bench -out bench/results; \
	fi
