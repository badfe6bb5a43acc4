package lockapi_test

import (
	"bytes"
	"context"
	"crypto/sha1"
	"encoding/hex"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/leash-go/leash/engine"
	"github.com/leash-go/leash/internal/scripts"
	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
)

// replyProxy is a loopback TCP proxy in front of a test server that can lose one
// reply: once armed with a marker, the first connection that sends a request
// containing the marker has the server's next reply dropped and is closed, so the
// server has run the command but the client never hears of it.
type replyProxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	marker []byte // armed when not nil
	times  int    // how many more requests with marker to hit after this one
	drop   bool   // drop the request itself (the server never sees it), not its reply
	cuts   int
	conns  []net.Conn
	closed bool
	wg     sync.WaitGroup
}

func newReplyProxy(t *testing.T, srv *testredis.Server) *replyProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &replyProxy{ln: ln, target: srv.Addr()}
	p.wg.Go(p.accept)
	t.Cleanup(p.close)
	return p
}

func (p *replyProxy) Addr() string { return p.ln.Addr().String() }

// arm makes the next request that contains marker lose its reply.
func (p *replyProxy) arm(marker string) { p.armN(marker, 1, false) }

// armN makes the next n requests that contain marker lose their replies, or, with
// drop, never reach the server.
func (p *replyProxy) armN(marker string, n int, drop bool) {
	p.mu.Lock()
	p.marker = []byte(marker)
	p.times = n - 1
	p.drop = drop
	p.mu.Unlock()
}

func (p *replyProxy) cutCount() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cuts
}

// ctxEndingAfterCut returns a context that ends once p has cut a reply: the call
// ran on the server and its client is about to retry, so the context ends after
// the call went out however slow the machine is (a fixed 5 ms could end before the
// engine sent it, with a race suite and a storm loop running beside it).
func ctxEndingAfterCut(t *testing.T, p *replyProxy) context.Context {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		defer cancel()
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		giveUp := time.NewTimer(10 * time.Second)
		defer giveUp.Stop()
		for p.cutCount() == 0 {
			select {
			case <-tick.C:
			case <-giveUp.C:
				return
			case <-stop:
				return
			}
		}
	})
	t.Cleanup(func() {
		close(stop)
		wg.Wait()
	})
	return ctx
}

func (p *replyProxy) accept() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		s, err := net.Dial("tcp", p.target)
		if err != nil {
			c.Close()
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			s.Close()
			return
		}
		p.conns = append(p.conns, c, s)
		p.mu.Unlock()
		doomed := make(chan struct{})
		var once sync.Once
		p.wg.Go(func() { // client -> server
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				if n > 0 {
					p.mu.Lock()
					drop := false
					if p.marker != nil && bytes.Contains(buf[:n], p.marker) {
						drop = p.drop
						if p.times == 0 {
							p.marker = nil
						}
						p.times--
						once.Do(func() { close(doomed) })
					}
					if drop {
						p.cuts++
					}
					p.mu.Unlock()
					if drop {
						break
					}
					if _, werr := s.Write(buf[:n]); werr != nil {
						break
					}
				}
				if err != nil {
					break
				}
			}
			s.Close()
			c.Close()
		})
		p.wg.Go(func() { // server -> client
			buf := make([]byte, 64<<10)
			for {
				n, err := s.Read(buf)
				if n > 0 {
					select {
					case <-doomed:
						// The server ran the request: drop its reply and the
						// connection.
						p.mu.Lock()
						p.cuts++
						p.mu.Unlock()
						c.Close()
						s.Close()
						return
					default:
					}
					if _, werr := c.Write(buf[:n]); werr != nil {
						break
					}
				}
				if err != nil {
					break
				}
			}
			c.Close()
			s.Close()
		})
	}
}

func (p *replyProxy) close() {
	p.mu.Lock()
	p.closed = true
	conns := p.conns
	p.mu.Unlock()
	p.ln.Close()
	for _, c := range conns {
		c.Close()
	}
	p.wg.Wait()
}

// mutexOf is c's handle on name: its fair lock, or its Mutex.
func mutexOf(c *lockapi.Client, name string, fair bool) *lockapi.Mutex {
	if fair {
		return c.FairMutex(name)
	}
	return c.Mutex(name)
}

// TestUnlockReplyLostKeepsCount: a handle holds the lock twice (re-entered) and
// Unlocks once; the server runs the release (count 2 -> 1) but its reply is lost
// with the connection. The engine retries the release once after a transport
// error. The handle must still hold the lock once, and no other client may get
// it.
func TestUnlockReplyLostKeepsCount(t *testing.T) {
	t.Parallel()
	for _, fair := range []bool{false, true} {
		t.Run(map[bool]string{false: "Mutex", true: "FairMutex"}[fair], func(t *testing.T) {
			t.Parallel()
			testUnlockReplyLostKeepsCount(t, fair)
		})
	}
}

func testUnlockReplyLostKeepsCount(t *testing.T, fair bool) {
	srv := testredis.New(t)
	proxy := newReplyProxy(t, srv)
	c := newClient(t, srv, lockapi.Options{Addrs: []string{proxy.Addr()}, OpTimeout: 2 * time.Second})
	other := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	handle := func(c *lockapi.Client) *lockapi.Mutex { return mutexOf(c, name, fair) }

	m := handle(c)
	lockWithin(t, m, 5*time.Second)
	lockWithin(t, m, 5*time.Second) // re-entered: count 2
	// Once more and an Unlock, so the release script is in the server's cache:
	// the reply to drop is then the script's, not a NOSCRIPT.
	lockWithin(t, m, 5*time.Second)
	unlock(t, m)
	if n, err := m.HoldCount(ctxFor(t, 5*time.Second)); err != nil || n != 2 {
		t.Fatalf("HoldCount = %d, %v; want 2", n, err)
	}
	field := engine.OwnerField(c.ID(), 1)
	if got := do(t, srv, "HGET", name, field); got != "2" {
		t.Fatalf("HGET %s %s = %q, want 2 (is the handle's owner 1?)", name, field, got)
	}
	lost := m.Lost()

	proxy.arm(field)
	err := m.Unlock(ctxFor(t, 10*time.Second))
	if proxy.cutCount() != 1 {
		t.Fatalf("the proxy cut %d replies, want 1 (Unlock: %v)", proxy.cutCount(), err)
	}
	t.Logf("Unlock with its reply lost: %v", err)
	count := do(t, srv, "HGET", name, field)
	n, herr := m.HoldCount(ctxFor(t, 5*time.Second))
	ok, terr := handle(other).TryLock(ctxFor(t, 5*time.Second), 0, 0)
	t.Logf("after one Unlock of two holds: Redis count %q, HoldCount %d (%v), Lost closed %v, another client's TryLock %v (%v)",
		count, n, herr, isClosed(lost), ok, terr)
	switch {
	case err == nil && ok && !isClosed(lost):
		t.Errorf("mutual exclusion broken: the handle still holds once (two Locks, one Unlock that returned nil), its Lost is open, and another client's TryLock got the lock")
	case ok && !isClosed(lost):
		t.Errorf("another client got the lock while the handle's Lost is open (Unlock: %v)", err)
	case err == nil && count != "1":
		t.Errorf("Unlock returned nil but Redis's count of the handle is %q, want 1 (HoldCount %d)", count, n)
	}
}

// TestLockReplyLost: the reply to a Lock's acquire (or re-entry) is lost after
// the server ran it; the engine retries after a back-off, and the caller's context
// ends as the reply is cut, before or during that back-off ("-cancel"), or not at
// all.
//
// A Lock that returned an error must not leave the lock held: with no earlier
// hold ("Mutex-cancel", "FairMutex-cancel") the lock must be free at once, not
// after its lease (30 s here). Where the handle holds, a surplus count on the
// server is documented (dropped at its last Unlock, see engine dropSurplus) and
// only logged; the lock must be free after the last Unlock, and nobody else may
// get it while the handle holds.
func TestLockReplyLost(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		fair    bool
		reenter bool
		cancel  bool          // the context ends once the reply is cut (ctxEndingAfterCut); else a long one
		wait    time.Duration // > 0: WithWait(wait) instead of a context's end
		// script: the handle's client has not released the lock yet, so a fair
		// lock's first attempt is the script (else RESTORE and LINDEX).
		script bool
	}{
		{"Mutex-wait", false, false, false, 5 * time.Millisecond, false},
		{"FairMutex-wait", true, false, false, 5 * time.Millisecond, false},
		{"Mutex", false, false, false, 0, false},
		{"Mutex-cancel", false, false, true, 0, false},
		{"Mutex-reenter", false, true, false, 0, false},
		{"Mutex-reenter-cancel", false, true, true, 0, false},
		{"FairMutex", true, false, false, 0, false},
		{"FairMutex-cancel", true, false, true, 0, false},
		{"FairMutex-script", true, false, false, 0, true},
		{"FairMutex-script-cancel", true, false, true, 0, true},
		{"FairMutex-reenter", true, true, false, 0, false},
		{"FairMutex-reenter-cancel", true, true, true, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := testredis.New(t)
			proxy := newReplyProxy(t, srv)
			c := newClient(t, srv, lockapi.Options{Addrs: []string{proxy.Addr()}, OpTimeout: 2 * time.Second})
			other := newClient(t, srv, lockapi.Options{})
			name := lockName(t, "")
			handle := func(c *lockapi.Client) *lockapi.Mutex { return mutexOf(c, name, tc.fair) }
			m := handle(c)
			// Warm the script cache: the reply to drop is the script's (or the
			// RESTORE's, below).
			warm := m
			if tc.script {
				warm = handle(other)
			}
			lockWithin(t, warm, 5*time.Second)
			lockWithin(t, warm, 5*time.Second)
			unlock(t, warm)
			unlock(t, warm)
			freedSoon(t, srv, name)
			held := 0
			if tc.reenter {
				lockWithin(t, m, 5*time.Second)
				held = 1
			}
			field := engine.OwnerField(c.ID(), 1)
			switch {
			case tc.fair && (tc.reenter || tc.script):
				proxy.arm(stormSHA(scripts.FairAcquire))
			case tc.reenter:
				proxy.arm(stormSHA(scripts.LockAcquire))
			default:
				// A first attempt on a lock that looks free goes as a RESTORE
				// (scripts.FreshRunner), with a LINDEX for a fair lock whose last
				// release here found nobody queued (scripts.FreshFairRunner):
				// its reply is the one to lose.
				proxy.arm("RESTORE")
			}
			ctx := ctxFor(t, 10*time.Second)
			if tc.cancel {
				ctx = ctxEndingAfterCut(t, proxy)
			}
			var opts []lockapi.AcquireOption
			if tc.wait > 0 {
				opts = append(opts, lockapi.WithWait(tc.wait))
			}
			err := m.Lock(ctx, opts...)
			if proxy.cutCount() != 1 {
				t.Fatalf("the proxy cut %d replies, want 1 (Lock: %v)", proxy.cutCount(), err)
			}
			if err == nil {
				held++
			}
			n, herr := m.HoldCount(ctxFor(t, 5*time.Second))
			t.Logf("Lock with its reply lost: %v; HoldCount %d (%v); Redis count %q, PTTL %s", err, n, herr,
				do(t, srv, "HGET", name, field), do(t, srv, "PTTL", name))
			if held == 0 {
				// Nothing held: the lock must be free, now, not when the lease ends.
				deadline := time.Now().Add(2 * time.Second)
				for do(t, srv, "EXISTS", name) == "1" {
					if time.Now().After(deadline) {
						t.Fatalf("Lock returned %v, yet 2 s later the lock is still held by the handle's field (hash %q, PTTL %s ms; stats %+v)",
							err, do(t, srv, "HGETALL", name), do(t, srv, "PTTL", name), stats(t, c))
					}
					time.Sleep(5 * time.Millisecond) // polling
				}
				return
			}
			if n != held {
				t.Logf("HoldCount %d, %d held: a surplus count (documented: dropped at the last Unlock)", n, held)
			}
			om := handle(other)
			if ok, err := om.TryLock(ctxFor(t, 5*time.Second), 0, 0); ok || err != nil {
				t.Errorf("another client's TryLock while the handle holds %d: %v, %v", held, ok, err)
			}
			for range held {
				unlock(t, m)
			}
			clientsSettled(t, c)
			eventually(t, 5*time.Second, "the lock to be free", func() bool { return do(t, srv, "EXISTS", name) == "0" })
		})
	}
}

// TestEarlyHandoffReplyLost: a local handoff grants the next local waiter early
// (before the reply), and the handoff call meets connection faults: its reply
// lost once or twice, or its request lost once or twice. Optionally the early
// holder unlocks at once to a third local waiter (a relay, while the handoff is
// in flight). Whatever happened, every local handle that was told it holds and
// whose Lost is still open must really hold the lock: another client's TryLock
// fails. At the end everything is released and the lock is free.
func TestEarlyHandoffReplyLost(t *testing.T) {
	t.Parallel()
	for _, fair := range []bool{false, true} {
		for _, relay := range []bool{false, true} {
			for _, drop := range []bool{false, true} {
				for _, n := range []int{1, 2} {
					name := fmt.Sprintf("fair=%v/relay=%v/drop=%v/n=%d", fair, relay, drop, n)
					t.Run(name, func(t *testing.T) {
						t.Parallel()
						testEarlyHandoffReplyLost(t, fair, relay, drop, n)
					})
				}
			}
		}
	}
}

func testEarlyHandoffReplyLost(t *testing.T, fair, relay, drop bool, n int) {
	srv := testredis.New(t)
	proxy := newReplyProxy(t, srv)
	c := newClient(t, srv, lockapi.Options{Addrs: []string{proxy.Addr()}, OpTimeout: 2 * time.Second})
	other := newClient(t, srv, lockapi.Options{})
	name := lockName(t, "")
	handle := func(c *lockapi.Client) *lockapi.Mutex { return mutexOf(c, name, fair) }
	a, b, cc := handle(c), handle(c), handle(c) // owners 1, 2, 3
	// Warm the script cache with a handoff: the replies to drop are then the
	// scripts'.
	lockWithin(t, a, 5*time.Second)
	bch := b.Acquire(ctxFor(t, 10*time.Second))
	eventually(t, 5*time.Second, "b to wait", func() bool { return stats(t, c).Waiters == 1 })
	unlock(t, a)
	if err, ok := receive(bch, 5*time.Second); !ok || err != nil {
		t.Fatalf("warm-up handoff: %v %v", err, ok)
	}
	unlock(t, b)
	freedSoon(t, srv, name)

	lockWithin(t, a, 5*time.Second)
	bch = b.Acquire(ctxFor(t, 10*time.Second))
	var cch <-chan error
	if relay {
		cch = cc.Acquire(ctxFor(t, 10*time.Second))
	}
	want := 1
	if relay {
		want = 2
	}
	eventually(t, 5*time.Second, "the waiters to wait", func() bool { return stats(t, c).Waiters == want })
	// HoldCount answers once its owner has no call in flight: the waiters'
	// refused attempts have been answered.
	if _, err := b.HoldCount(ctxFor(t, 5*time.Second)); err != nil {
		t.Fatal(err)
	}
	if relay {
		if _, err := cc.HoldCount(ctxFor(t, 5*time.Second)); err != nil {
			t.Fatal(err)
		}
	}
	bField := engine.OwnerField(c.ID(), 2)
	proxy.armN(bField, n, drop)
	uerr := a.Unlock(ctxFor(t, 10*time.Second))
	berr, ok := receive(bch, 10*time.Second)
	if !ok {
		t.Fatal("b's Acquire did not complete")
	}
	t.Logf("a's Unlock: %v; b's Acquire: %v", uerr, berr)
	type holder struct {
		m    *lockapi.Mutex
		lost <-chan struct{}
		name string
	}
	var holders []holder
	if berr == nil {
		holders = append(holders, holder{b, b.Lost(), "b"})
	}
	if relay && berr == nil {
		// b unlocks at once: the lock goes to c, maybe relayed while the handoff
		// is in flight.
		t.Logf("b's Unlock: %v", b.Unlock(ctxFor(t, 10*time.Second)))
		holders = holders[:0]
	}
	if relay {
		cerr, ok := receive(cch, 10*time.Second)
		if !ok {
			t.Fatal("c's Acquire did not complete")
		}
		t.Logf("c's Acquire: %v", cerr)
		if cerr == nil {
			holders = append(holders, holder{cc, cc.Lost(), "c"})
		}
	}
	t.Logf("proxy cut %d", proxy.cutCount())
	for _, h := range holders {
		n, err := h.m.HoldCount(ctxFor(t, 5*time.Second))
		lost := isClosed(h.lost)
		om := handle(other)
		ok, terr := om.TryLock(ctxFor(t, 5*time.Second), 0, 0)
		t.Logf("%s: HoldCount %d (%v), Lost closed %v, other's TryLock %v (%v), hash %q", h.name, n, err, lost, ok, terr, do(t, srv, "HGETALL", name))
		if ok {
			if !lost {
				t.Errorf("%s holds with its Lost open, yet another client got the lock", h.name)
			}
			unlock(t, om)
		}
		if !lost && n < 1 {
			t.Errorf("%s holds with its Lost open, yet HoldCount = %d", h.name, n)
		}
		h.m.Unlock(ctxFor(t, 5*time.Second))
	}
	clientsSettled(t, c, other)
	eventually(t, 10*time.Second, "the lock to be free", func() bool { return do(t, srv, "EXISTS", name) == "0" })
}

// TestGiveBackReplyLostKeepsCount: a handle holds the lock; an Acquire of the
// same handle (a re-entry) is granted, but its caller walks away (its context is
// cancelled before it receives), so the engine gives that one count back
// (lock_release_owner, drop 1). The give-back runs, but its reply is lost with
// the connection, and the engine retries it. The handle's first hold must stand.
func TestGiveBackReplyLostKeepsCount(t *testing.T) {
	t.Parallel()
	for _, fair := range []bool{false, true} {
		t.Run(map[bool]string{false: "Mutex", true: "FairMutex"}[fair], func(t *testing.T) {
			t.Parallel()
			srv := testredis.New(t)
			proxy := newReplyProxy(t, srv)
			c := newClient(t, srv, lockapi.Options{Addrs: []string{proxy.Addr()}, OpTimeout: 2 * time.Second})
			other := newClient(t, srv, lockapi.Options{})
			name := lockName(t, "")
			handle := func(c *lockapi.Client) *lockapi.Mutex { return mutexOf(c, name, fair) }
			m := handle(c)
			field := engine.OwnerField(c.ID(), 1)
			giveBack := func(arm bool) {
				t.Helper()
				ctx, cancel := context.WithCancel(context.Background())
				defer cancel()
				ch := m.Acquire(ctx) // re-entry, granted, never received
				eventually(t, 5*time.Second, "the re-entry to be granted", func() bool { return do(t, srv, "HGET", name, field) == "2" })
				if arm {
					// The give-back is the next request naming the handle's field,
					// alone or merged with others (no renewal comes this soon).
					proxy.arm(field)
				}
				cancel()
				eventually(t, 5*time.Second, "the give-back", func() bool {
					n, err := m.HoldCount(ctxFor(t, 5*time.Second))
					return err == nil && n < 2
				})
				select {
				case err := <-ch:
					if err == nil {
						t.Fatal("the walked-away Acquire's channel carries nil")
					}
				default:
					t.Fatal("the walked-away Acquire's channel is empty")
				}
			}
			lockWithin(t, m, 5*time.Second)
			giveBack(false) // warms the script cache
			lost := m.Lost()
			giveBack(true)
			if proxy.cutCount() != 1 {
				t.Fatalf("the proxy cut %d replies, want 1", proxy.cutCount())
			}
			n, err := m.HoldCount(ctxFor(t, 5*time.Second))
			om := handle(other)
			ok, terr := om.TryLock(ctxFor(t, 5*time.Second), 0, 0)
			t.Logf("after the give-back with its reply lost: HoldCount %d (%v), Lost closed %v, another client's TryLock %v (%v), hash %q",
				n, err, isClosed(lost), ok, terr, do(t, srv, "HGETALL", name))
			if ok && !isClosed(lost) {
				t.Errorf("mutual exclusion broken: the handle holds once (its Lost open), yet another client got the lock")
			}
		})
	}
}

// stormSHA is the SHA1 that EVALSHA names a script by.
func stormSHA(id scripts.ID) string {
	sum := sha1.Sum([]byte(scripts.Source(id)))
	return hex.EncodeToString(sum[:])
}
