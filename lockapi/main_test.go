package lockapi_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/leash-go/leash/engine"
	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// Integration and fault tests of the public package against real redis-server
// processes (internal/testredis). Conventions of every file in this package:
//
//   - each test starts its own server(s) and uses key names derived from t.Name();
//   - state is awaited with eventually (a polled condition with a deadline), never
//     with a sleep; a fixed wait appears only where the wait itself is the test
//     (holding a lock across renewals) and is then a timer, not a sleep;
//   - goroutines report with t.Error or over channels, never t.Fatal;
//   - bounds on time are generous sanity bounds (the machine has 2 noisy cores and
//     runs with -race); counts (script calls per handoff) are asserted exactly
//     where the design promises them.
func TestMain(m *testing.M) { testredis.Main(m) }

// eventually polls cond every few milliseconds until it holds, and fails the test
// if it does not within timeout. Call it from the test goroutine only.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	if !within(timeout, cond) {
		t.Fatalf("timed out after %v waiting for %s", timeout, what)
	}
}

// within polls cond every few milliseconds until it holds or timeout passes, and
// reports whether it held: eventually for a test that reports more on a timeout.
func within(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(3 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		<-tick.C
	}
	return true
}

// lockServerState describes a reentrant lock's keys on the server, for failure
// reports: its hash and PTTL, its unlock channel's listeners, and its direct-grant
// registrations.
func lockServerState(t *testing.T, srv *testredis.Server, name string) string {
	t.Helper()
	return fmt.Sprintf("%s: HGETALL %q PTTL %s numsub %s reg %q regq %q", name, do(t, srv, "HGETALL", name), do(t, srv, "PTTL", name),
		numSub(t, srv, engine.ChannelName(name)), do(t, srv, "HGETALL", "leash_lock_reg:{"+name+"}"), do(t, srv, "LRANGE", "leash_lock_regq:{"+name+"}", "0", "-1"))
}

// lockName returns a key name unique to the test (and to tag, when a test needs
// several locks).
func lockName(t testing.TB, tag string) string {
	name := "leash-test:" + strings.NewReplacer("/", ":", " ", "_").Replace(t.Name())
	if tag != "" {
		name += ":" + tag
	}
	return name
}

// newClient connects a client to srv; it is closed when the test ends (before the
// server stops: cleanups run last-registered first). Tests may Close it earlier.
func newClient(t *testing.T, srv *testredis.Server, opts lockapi.Options) *lockapi.Client {
	t.Helper()
	if len(opts.Addrs) == 0 && opts.Client == nil {
		opts.Addrs = []string{srv.Addr()}
	}
	c, err := lockapi.New(opts)
	if err != nil {
		t.Fatalf("lockapi.New: %v", err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// do runs a raw command on srv and fails the test on an error reply.
func do(t *testing.T, srv *testredis.Server, args ...string) string {
	t.Helper()
	got, err := srv.Do(args...)
	if err != nil {
		t.Fatalf("redis %q: %v", args, err)
	}
	return got
}

// ctxFor returns a context bounded by d and cancelled when the test ends.
func ctxFor(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// lockWithin takes m or fails the test.
func lockWithin(t *testing.T, m *lockapi.Mutex, d time.Duration, opts ...lockapi.AcquireOption) {
	t.Helper()
	if err := m.Lock(ctxFor(t, d), opts...); err != nil {
		t.Fatalf("Lock(%q): %v", m.Name(), err)
	}
}

// unlock releases m or fails the test.
func unlock(t *testing.T, m *lockapi.Mutex) {
	t.Helper()
	if err := m.Unlock(ctxFor(t, 5*time.Second)); err != nil {
		t.Fatalf("Unlock(%q): %v", m.Name(), err)
	}
}

// stats returns c's engine counters or fails the test.
func stats(t *testing.T, c *lockapi.Client) engine.Stats {
	t.Helper()
	s, err := c.Stats(ctxFor(t, 5*time.Second))
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	return s
}

// isClosed reports whether a signal channel (Lost) is closed, without waiting.
func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// pending reports whether an Acquire channel is still without a value after d:
// the one place a short fixed wait is the assertion itself ("it has not completed
// yet"). If a value arrived, it is returned so the caller can report it.
func pending(ch <-chan error, d time.Duration) (stillPending bool, got error) {
	select {
	case err := <-ch:
		return false, err
	case <-time.After(d):
		return true, nil
	}
}

// receive waits up to d for an Acquire channel's value; ok is false on timeout.
func receive(ch <-chan error, d time.Duration) (err error, ok bool) {
	select {
	case err := <-ch:
		return err, true
	case <-time.After(d):
		return nil, false
	}
}

// mustBeLocked asserts whether the lock exists on the server.
func mustBeLocked(t *testing.T, srv *testredis.Server, name string, want bool) {
	t.Helper()
	got := do(t, srv, "EXISTS", name) == "1"
	if got != want {
		t.Fatalf("EXISTS %s = %v, want %v (HGETALL: %q)", name, got, want, do(t, srv, "HGETALL", name))
	}
}

// freedSoon waits for name to be free: after a release that may have granted the
// lock directly to a registered waiter that was giving up just then (the grant
// goes back within a round trip; see engine/directgrant.go).
func freedSoon(t *testing.T, srv *testredis.Server, name string) {
	t.Helper()
	eventually(t, 5*time.Second, name+" to be free", func() bool { return do(t, srv, "EXISTS", name) == "0" })
}

// isErr is errors.Is with a readable failure.
func isErr(t *testing.T, what string, err, target error) {
	t.Helper()
	if !errors.Is(err, target) {
		t.Fatalf("%s: err = %v, want errors.Is(err, %v)", what, err, target)
	}
}

// freeze pauses srv (SIGSTOP) and returns when it did, with a resume function
// that may be called once; the server is resumed at cleanup if it was not.
func freeze(t *testing.T, srv *testredis.Server) (pausedAt time.Time, resume func()) {
	t.Helper()
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	pausedAt = time.Now()
	resumed := false
	t.Cleanup(func() {
		if !resumed {
			srv.Resume()
		}
	})
	return pausedAt, func() {
		t.Helper()
		resumed = true
		if err := srv.Resume(); err != nil {
			t.Fatal(err)
		}
	}
}

// clientsSettled waits until every client has no waiter and no hold.
func clientsSettled(t *testing.T, cs ...*lockapi.Client) {
	t.Helper()
	for i, c := range cs {
		eventually(t, 10*time.Second, fmt.Sprintf("client %d to settle", i), func() bool {
			s := stats(t, c)
			return s.Waiters == 0 && s.Holds == 0
		})
	}
}

// mutexSettled waits until every client has settled and the Mutex's key is gone.
func mutexSettled(t *testing.T, srv *testredis.Server, name string, cs ...*lockapi.Client) {
	t.Helper()
	clientsSettled(t, cs...)
	eventually(t, 10*time.Second, "the lock to go", func() bool { return do(t, srv, "EXISTS", name) == "0" })
}
