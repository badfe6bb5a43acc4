package engine

import (
	"context"
	"testing"

	"github.com/leash-go/leash/internal/scripts"
)

// serve runs call on the in-memory server and returns its reply (the server ran it).
func serve(t *testing.T, r *memRedis, call scriptCall) scripts.Reply {
	t.Helper()
	reply, err := r.Run(context.Background(), call.script, call.keys, call.args)
	if err != nil {
		t.Fatalf("memRedis: %v", err)
	}
	return reply
}

// serveAll runs on srv every call the machine sends, and hands it their replies,
// until it sends nothing more (ten rounds at most).
func serveAll(t *testing.T, h *mh, srv *memRedis) {
	t.Helper()
	for range 10 {
		s := h.take()
		if len(s.scripts) == 0 {
			return
		}
		for _, c := range s.scripts {
			h.reply(c, serve(t, srv, c), nil)
		}
	}
}

// A walked-away grant whose hold may count a surplus (maySurplus) is taken back
// while a re-entry of the same handle (another goroutine sharing it) is in flight.
// The take-back's give-back is the whole field (releaseOne: the hold's last count,
// and maybe a surplus) and it is parked behind the re-entry (parkCleanup). The
// re-entry is granted: a new hold under the same field. The parked give-back then
// runs, not being a lost hold's clean-up (runCleanup checks only afterLoss), and
// deletes the field whole: the new hold is gone on the server while its Lost is
// open, and another handle of the same client is granted on the unlock message.
//
//  1. g18 (owner 1) Acquire: its first attempt runs (count 1) but its reply is
//     lost (CLIENT KILL); the retry runs (count 2) and is granted: h, count 1,
//     maySurplus. g18 has not received the grant yet.
//  2. g21 (owner 1, the same handle) Lock: a re-entry, sent.
//  3. g18's context ends: takeBack → releaseOne(h, afterCalls): count 0 and
//     maySurplus, so a whole-field give-back, parked behind the re-entry; h dropped.
//  4. The re-entry runs (count 3) and is granted: hold h2, count 1; g21 is inside.
//  5. markIdle sends the parked give-back: HDEL of owner 1's field, DEL, publish.
//  6. Owner 2's (g36) waiter hears the unlock message and takes the lock.
func TestMachineTakeBackBehindReentryKeepsReentry(t *testing.T) {
	h := newMH(t)
	srv := newMemRedis()
	field1 := ownerField(testClientID, 1)

	// 1. g18's Acquire; the first attempt runs but its reply is lost.
	g18 := h.acquire("L", 1, 0, -1)
	a1 := h.take().one(t, scripts.LockAcquire)
	serve(t, srv, a1)
	h.reply(a1, scripts.Reply{}, errConn)
	retry := h.take().retryArmed(t)
	h.now = h.now.Add(retry.d)
	h.fire(retry.key)
	a2 := h.take().one(t, scripts.LockAcquire)
	h.reply(a2, serve(t, srv, a2), nil)
	h.take()
	hd := h.hold("L", 1)
	if hd == nil || !hd.maySurplus || hd.count != 1 {
		t.Fatalf("setup: hold %+v, want count 1 and maySurplus", hd)
	}
	if _, ok := h.m.receipts[g18.id]; !ok {
		t.Fatalf("setup: g18's grant is not watched for a take-back")
	}

	// g36 (owner 2, another handle of this client) waits: parked behind the local hold.
	g36 := h.acquire("L", 2, 0, -1)
	h.take().none(t)

	// 2. g21's Lock on the same handle: a re-entry, in flight.
	g21 := h.acquire("L", 1, 0, -1)
	re := h.take().one(t, scripts.LockAcquire)

	// 3. g18 walks away: its grant is taken back.
	h.cancelCtx(g18)
	h.take().none(t) // the give-back waits for the re-entry

	// 4. The re-entry runs and is granted.
	h.reply(re, serve(t, srv, re), nil)
	mustGranted(t, "g21's re-entry", g21.future)
	h2 := h.hold("L", 1)
	if h2 == nil {
		t.Fatalf("owner 1 holds nothing after its re-entry was granted")
	}
	lost := h2.lostSignal().C()

	// 5. Whatever the engine sends now runs; then the unlock message, if any
	// release published one, reaches this client (g36's head attempts).
	serveAll(t, h, srv)
	h.notice("L")
	serveAll(t, h, srv)

	if h.hold("L", 1) == nil {
		t.Fatalf("owner 1's hold ended with nothing asked of it")
	}
	mustNotFired(t, "g21's Lost", lost)
	if srv.holders("L")[field1] == 0 {
		t.Errorf("owner 1 holds L here (count %d, Lost open), but the server has no field %s: %v; "+
			"the walked-away grant's whole-field give-back, parked behind the re-entry, ran after it",
			h.hold("L", 1).count, field1, srv.holders("L"))
	}
	if err, ok := peek(g36.future); ok && err == nil {
		t.Fatalf("owner 2 (g36) granted while owner 1 (g21) holds with its Lost open; server %v", srv.holders("L"))
	}

	// g21's Unlock: the server's surplus goes with it, and owner 2 gets the lock.
	f := h.unlock("L", 1)
	serveAll(t, h, srv)
	if err := mustGet(t, "g21's Unlock", f); err != nil {
		t.Fatalf("g21's Unlock: %v", err)
	}
	if got := srv.holders("L"); got[field1] != 0 {
		t.Fatalf("after owner 1's last Unlock the server still has %v", got)
	}
	if _, ok := peek(g36.future); !ok {
		h.notice("L")
		serveAll(t, h, srv)
	}
	mustGranted(t, "g36 after owner 1's Unlock", g36.future)
}
