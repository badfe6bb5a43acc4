package engine

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/timer"
)

// The engine-level fakes (layer 2): an in-memory model of the Redisson lock scripts,
// a script runner whose replies the test hands out one by one, a pub/sub
// subscriber, and a harness that starts an Engine on them with the fake timer.

// ---- memRedis: the scripts' semantics on an in-memory keyspace ----

// memRedis models the keys the lock scripts touch: one hash per lock, field = owner,
// value = hold count, with an expiry on a fake clock that only the test moves.
// Every script runs atomically under mu, as Lua does on a real server.
type memRedis struct {
	mu      sync.Mutex
	clock   time.Duration // fake server time
	keys    map[string]*memHash
	calls   map[scripts.ID]int
	publish func(channel, message string) // set before use; called outside mu

	// before, when set, runs before each script and may fail it (a transport error
	// that leaves the server untouched).
	before func(id scripts.ID, keys, args []string) error
}

type memHash struct {
	fields   map[string]int64
	expireAt time.Duration // 0: no expiry
}

var _ scripts.Runner = (*memRedis)(nil)

func newMemRedis() *memRedis {
	return &memRedis{keys: make(map[string]*memHash), calls: make(map[scripts.ID]int)}
}

// advance moves the server clock: keys whose expiry has passed disappear.
func (r *memRedis) advance(d time.Duration) {
	r.mu.Lock()
	r.clock += d
	r.mu.Unlock()
}

func (r *memRedis) count(id scripts.ID) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.calls[id]
}

// holders returns a copy of a lock's fields, or nil when the key does not exist.
func (r *memRedis) holders(name string) map[string]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.get(name)
	if h == nil {
		return nil
	}
	out := make(map[string]int64, len(h.fields))
	for f, n := range h.fields {
		out[f] = n
	}
	return out
}

// set writes a hash directly (a holder in another process).
func (r *memRedis) set(name, field string, count int64, ttl time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := &memHash{fields: map[string]int64{field: count}}
	if ttl > 0 {
		h.expireAt = r.clock + ttl
	}
	r.keys[name] = h
}

func (r *memRedis) get(name string) *memHash {
	h := r.keys[name]
	if h != nil && h.expireAt != 0 && h.expireAt <= r.clock {
		delete(r.keys, name)
		return nil
	}
	return h
}

func (r *memRedis) pexpire(name, ms string) {
	n, _ := strconv.ParseInt(ms, 10, 64)
	if h := r.get(name); h != nil {
		h.expireAt = r.clock + time.Duration(n)*time.Millisecond
	}
}

func (r *memRedis) pttl(name string) int64 {
	h := r.get(name)
	switch {
	case h == nil:
		return -2
	case h.expireAt == 0:
		return -1
	default:
		return (h.expireAt - r.clock).Milliseconds()
	}
}

// Run implements scripts.Runner.
func (r *memRedis) Run(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	if err := ctx.Err(); err != nil {
		return scripts.Reply{}, err
	}
	if r.before != nil {
		if err := r.before(id, keys, args); err != nil {
			return scripts.Reply{}, err
		}
	}
	var pub [][2]string
	r.mu.Lock()
	r.calls[id]++
	reply := r.run(id, keys, args, &pub)
	send := r.publish
	r.mu.Unlock()
	for _, p := range pub {
		if send != nil {
			send(p[0], p[1])
		}
	}
	return reply, nil
}

// batchMem is memRedis as a scripts.BatchRunner, so the engine sends merged
// batches (batchDone, recycle) as it does against Redis. Each batch yields the
// processor between its calls, so that other batches and requests interleave.
type batchMem struct {
	*memRedis
	batches, merged atomic.Int64 // RunBatch calls, and those with more than one call
}

var _ scripts.BatchRunner = (*batchMem)(nil)

// RunBatch implements scripts.BatchRunner: the calls in order, as the multi
// script runs them.
func (b *batchMem) RunBatch(ctx context.Context, calls []scripts.Call, out []scripts.Result) []scripts.Result {
	b.batches.Add(1)
	if len(calls) > 1 {
		b.merged.Add(1)
	}
	out = slices.Grow(out[:0], len(calls))[:len(calls)] // the engine's reused slice, as Redis.RunBatch
	for i, c := range calls {
		out[i].Reply, out[i].Err = b.Run(ctx, c.ID, c.Keys, c.Args)
		runtime.Gosched()
	}
	return out
}

func (r *memRedis) run(id scripts.ID, keys, args []string, pub *[][2]string) scripts.Reply {
	switch id {
	case scripts.LockAcquire: // KEYS lock; ARGV lease, field
		h := r.get(keys[0])
		if h == nil {
			h = &memHash{fields: make(map[string]int64)}
			r.keys[keys[0]] = h
		} else if _, ok := h.fields[args[1]]; !ok {
			return scripts.Reply{Int: r.pttl(keys[0])}
		}
		h.fields[args[1]]++
		r.pexpire(keys[0], args[0])
		return scripts.Reply{Nil: true}
	case scripts.LockRelease: // KEYS lock, channel; ARGV message, lease, field, ..., ARGV[7] keep
		h := r.get(keys[0])
		if h == nil || h.fields[args[2]] == 0 {
			return scripts.Reply{Nil: true}
		}
		if keep := argInt(args, 6); keep > 0 && h.fields[args[2]] <= keep {
			r.pexpire(keys[0], args[1])
			return scripts.Reply{Int: 0} // a retry of a release that ran
		}
		h.fields[args[2]]--
		if h.fields[args[2]] > 0 {
			r.pexpire(keys[0], args[1])
			return scripts.Reply{Int: 0}
		}
		delete(r.keys, keys[0])
		*pub = append(*pub, [2]string{keys[1], args[0]})
		return scripts.Reply{Int: 1}
	case scripts.LockReleaseOwner: // KEYS lock, channel; ARGV message, field, drop, keep
		h := r.get(keys[0])
		if h == nil || h.fields[args[1]] == 0 {
			return scripts.Reply{Int: -1}
		}
		drop, _ := strconv.ParseInt(args[2], 10, 64)
		if keep := argInt(args, 3); drop > 0 && keep > 0 {
			if drop = min(drop, h.fields[args[1]]-keep); drop <= 0 {
				return scripts.Reply{Int: 0} // a retry of a give-back that ran
			}
		}
		if drop > 0 {
			h.fields[args[1]] -= drop
			if h.fields[args[1]] > 0 {
				return scripts.Reply{Int: 0}
			}
		}
		delete(h.fields, args[1])
		if len(h.fields) == 0 {
			delete(r.keys, keys[0])
			*pub = append(*pub, [2]string{keys[1], args[0]})
			return scripts.Reply{Int: 1}
		}
		return scripts.Reply{Int: 0}
	case scripts.LockForceRelease: // KEYS lock, channel; ARGV message
		if r.get(keys[0]) == nil {
			return scripts.Reply{Int: 0}
		}
		delete(r.keys, keys[0])
		*pub = append(*pub, [2]string{keys[1], args[0]})
		return scripts.Reply{Int: 1}
	case scripts.LockRenew: // KEYS locks; ARGV lease, fields...
		out := make([]int64, len(keys))
		for i, k := range keys {
			if h := r.get(k); h != nil && h.fields[args[i+1]] > 0 {
				r.pexpire(k, args[0])
				out[i] = 1
			}
		}
		return scripts.Reply{Ints: out}
	case scripts.LockHandoff: // KEYS lock, channel; ARGV field, lease, next field, next lease, bound, message, retry
		h := r.get(keys[0])
		if h == nil || h.fields[args[0]] == 0 {
			if h != nil && args[6] == "1" && h.fields[args[2]] > 0 {
				return scripts.Reply{Int: 2} // the first try ran
			}
			return scripts.Reply{Nil: true}
		}
		h.fields[args[0]]--
		if h.fields[args[0]] > 0 {
			r.pexpire(keys[0], args[1])
			return scripts.Reply{Int: 0}
		}
		// The model does not count subscribers: at the chain bound it assumes
		// another process listens, and releases to everyone.
		if args[4] == "1" {
			delete(r.keys, keys[0])
			*pub = append(*pub, [2]string{keys[1], args[5]})
			return scripts.Reply{Int: 1}
		}
		r.keys[keys[0]] = &memHash{fields: map[string]int64{args[2]: 1}}
		r.pexpire(keys[0], args[3])
		if len(args) > 11 && args[11] == "1" {
			return scripts.Reply{Int: 5} // asked: another process listens, as above
		}
		return scripts.Reply{Int: 2}
	case scripts.LockLeave: // KEYS lock, channel, regs, order; ARGV client, waiter, grant field, message, ...
		// The model keeps no registrations, so it never grants directly: a
		// waiter's grant field is never on a key, and a leave changes nothing.
		if h := r.get(keys[0]); h != nil && h.fields[args[2]] > 0 {
			panic("memRedis: a grant field on a key")
		}
		return scripts.Reply{Int: 0}
	}
	panic(fmt.Sprintf("memRedis: unknown script %v", id))
}

// argInt is args[i] as an integer, 0 when absent.
func argInt(args []string, i int) int64 {
	if i >= len(args) {
		return 0
	}
	n, _ := strconv.ParseInt(args[i], 10, 64)
	return n
}

// ---- manualRunner: every call waits for the test's answer ----

// call is one script call a manualRunner holds until the test answers it.
type call struct {
	id    scripts.ID
	keys  []string
	args  []string
	reply chan callResult // capacity 1: the test's answer never blocks
}

type callResult struct {
	reply scripts.Reply
	err   error
}

func (c *call) answer(r scripts.Reply, err error) { c.reply <- callResult{r, err} }

// manualRunner hands every call to the test on calls and returns what the test
// answers, or the context's error (the engine's own deadline, or Close's).
type manualRunner struct {
	calls     chan *call // generous capacity: the engine's I/O goroutines never wait on the test to post
	aborted   chan struct{}
	abortOnce sync.Once
}

// abort fails every call in flight and every later one, as closing a rueidis client
// does; it is the engine's AbortIO in tests.
func (r *manualRunner) abort() { r.abortOnce.Do(func() { close(r.aborted) }) }

var _ scripts.Runner = (*manualRunner)(nil)

func newManualRunner() *manualRunner {
	return &manualRunner{calls: make(chan *call, 1024), aborted: make(chan struct{})}
}

var errAborted = errors.New("aborted")

func (r *manualRunner) Run(ctx context.Context, id scripts.ID, keys, args []string) (scripts.Reply, error) {
	c := &call{id: id, keys: keys, args: args, reply: make(chan callResult, 1)}
	select {
	case r.calls <- c:
	case <-ctx.Done():
		return scripts.Reply{}, ctx.Err()
	case <-r.aborted:
		return scripts.Reply{}, errAborted
	}
	select {
	case res := <-c.reply:
		return res.reply, res.err
	case <-ctx.Done():
		return scripts.Reply{}, ctx.Err()
	case <-r.aborted:
		return scripts.Reply{}, errAborted
	}
}

// next waits for the next call, failing the test after a deadline.
func (r *manualRunner) next(t *testing.T) *call {
	t.Helper()
	select {
	case c := <-r.calls:
		return c
	case <-time.After(5 * time.Second):
		t.Fatal("no script call within 5s")
		return nil
	}
}

// expect waits for the next call and checks its script.
func (r *manualRunner) expect(t *testing.T, id scripts.ID) *call {
	t.Helper()
	c := r.next(t)
	if c.id != id {
		t.Fatalf("script call %v keys=%v args=%v, want %v", c.id, c.keys, c.args, id)
	}
	return c
}

// quiet fails if a call arrives within d: a bounded check that something does not
// happen (there is no event to wait for instead).
func (r *manualRunner) quiet(t *testing.T, d time.Duration) {
	t.Helper()
	select {
	case c := <-r.calls:
		t.Fatalf("unexpected script call %v keys=%v args=%v", c.id, c.keys, c.args)
	case <-time.After(d):
	}
}

// ---- fakeSub: the pub/sub registry ----

// fakeSub records subscriptions; a publish reaches the engine only on a subscribed
// channel, as on a real server.
type fakeSub struct {
	mu       sync.Mutex
	channels map[string]bool
	subs     int
	notify   func(channel, message string) // the engine's NotifyMessage
}

var _ Subscriber = (*fakeSub)(nil)

func newFakeSub() *fakeSub { return &fakeSub{channels: make(map[string]bool)} }

func (s *fakeSub) Subscribe(ctx context.Context, channel string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.channels[channel] = true
	s.subs++
	return nil
}

func (s *fakeSub) Unsubscribe(ctx context.Context, channel string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.channels, channel)
}

// PSubscribe and PUnsubscribe record patterns like channels (fair locks only;
// these tests use the reentrant lock).
func (s *fakeSub) PSubscribe(ctx context.Context, pattern string) error {
	return s.Subscribe(ctx, pattern)
}

func (s *fakeSub) PUnsubscribe(ctx context.Context, pattern string) { s.Unsubscribe(ctx, pattern) }

func (s *fakeSub) subscribed(channel string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.channels[channel]
}

// deliver is memRedis's publish: it hands the message to the engine when the
// channel is subscribed. NotifyMessage never blocks.
func (s *fakeSub) deliver(channel, message string) {
	s.mu.Lock()
	ok, notify := s.channels[channel], s.notify
	s.mu.Unlock()
	if ok && notify != nil {
		notify(channel, message)
	}
}

// ---- the engine harness ----

type eh struct {
	t     *testing.T
	e     *Engine
	timer *recSched
	sink  timer.Sink
	sub   *fakeSub
}

// recSched is the fake timer, recording the last entry armed of each kind (the
// fake cannot list its entries, and generations are the machine's business).
type recSched struct {
	*timer.Fake
	mu   sync.Mutex
	last map[uint8]armedEntry
}

type armedEntry struct {
	key timer.Key
	d   time.Duration
}

func (s *recSched) Schedule(key timer.Key, d time.Duration) {
	s.mu.Lock()
	s.last[key.Kind] = armedEntry{key, d}
	s.mu.Unlock()
	s.Fake.Schedule(key, d)
}

// lastArmed returns the last entry of kind the engine armed, if it is still armed.
func (h *eh) lastArmed(kind uint8) (timer.Key, time.Duration, bool) {
	h.timer.mu.Lock()
	e, ok := h.timer.last[kind]
	h.timer.mu.Unlock()
	if !ok {
		return timer.Key{}, 0, false
	}
	if _, armed := h.timer.Armed(e.key); !armed {
		return timer.Key{}, 0, false
	}
	return e.key, e.d, true
}

// newEngine starts an Engine on runner with a fake subscriber and the fake timer,
// and closes it when the test ends.
func newEngine(t *testing.T, runner scripts.Runner, mutate ...func(*Config)) *eh {
	t.Helper()
	h := &eh{t: t, sub: newFakeSub()}
	cfg := Config{
		ClientID:   testClientID,
		Watchdog:   30 * time.Second,
		Runner:     runner,
		Subscriber: h.sub,
		Scheduler: func(sink timer.Sink) timer.Scheduler {
			h.timer, h.sink = &recSched{Fake: timer.NewFake(), last: make(map[uint8]armedEntry)}, sink
			return h.timer
		},
		CloseTimeout: 2 * time.Second,
		PublicYield:  -1, // a yield waits for a timer, and the fake one moves only when told
	}
	if r, ok := runner.(*manualRunner); ok {
		cfg.AbortIO = r.abort
	}
	for _, f := range mutate {
		f(&cfg)
	}
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.e = e
	h.sub.notify = e.NotifyMessage
	t.Cleanup(e.Close)
	return h
}

// advance moves the fake timer and hands every key that came due to the engine.
func (h *eh) advance(d time.Duration) {
	for _, k := range h.timer.Advance(d) {
		h.sink(k)
	}
}

func (h *eh) stats() Stats {
	h.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	s, err := h.e.Stats(ctx)
	if err != nil {
		h.t.Fatalf("Stats: %v", err)
	}
	return s
}

// eventually waits for cond, checking it every millisecond, for at most 5 s.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	if !within(5*time.Second, cond) {
		t.Fatalf("timed out waiting for %s", what)
	}
}

// within reports whether cond became true within d, checking it every millisecond.
func within(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		<-tick.C
	}
	return true
}

// recv waits for a future's value, for at most 5 s.
func recv(t *testing.T, what string, c <-chan error) error {
	t.Helper()
	select {
	case err := <-c:
		return err
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: no value within 5s", what)
		return nil
	}
}
