package lockapi_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/leash-go/leash/internal/testredis"
	"github.com/leash-go/leash/lockapi"
	"github.com/redis/rueidis"
)

// A foreign Redisson FairLock client, played with raw Lua over EVAL. The scripts
// are written here from PROTOCOL.md's description of the FairLock layout, and share
// nothing with leash's own scripts.
const (
	// fairForeignAcquire: KEYS[1] lock, KEYS[2] queue, KEYS[3] deadlines;
	// ARGV[1] lease ms, ARGV[2] owner, ARGV[3] wait allowance ms, ARGV[4] now ms.
	// Reply: nil when held, else the time to wait in ms.
	fairForeignAcquire = `
local lockKey, queueKey, deadlineKey = KEYS[1], KEYS[2], KEYS[3]
local lease, me = tonumber(ARGV[1]), ARGV[2]
local allowance, now = tonumber(ARGV[3]), tonumber(ARGV[4])

-- drop heads whose turn passed
local first = redis.call('lindex', queueKey, 0)
while first do
	local due = redis.call('zscore', deadlineKey, first)
	if due and tonumber(due) > now then
		break
	end
	redis.call('lpop', queueKey)
	redis.call('zrem', deadlineKey, first)
	first = redis.call('lindex', queueKey, 0)
end

if redis.call('exists', lockKey) == 0 and (not first or first == me) then
	if first == me then
		redis.call('lpop', queueKey)
	end
	redis.call('zrem', deadlineKey, me)
	local behind = redis.call('zrange', deadlineKey, 0, -1)
	for _, other in ipairs(behind) do
		redis.call('zincrby', deadlineKey, -allowance, other)
	end
	redis.call('hset', lockKey, me, 1)
	redis.call('pexpire', lockKey, lease)
	return nil
end

if redis.call('hexists', lockKey, me) == 1 then
	redis.call('hincrby', lockKey, me, 1)
	redis.call('pexpire', lockKey, lease)
	return nil
end

local mine = redis.call('zscore', deadlineKey, me)
if mine then
	return tonumber(mine) - allowance - now
end

local last = redis.call('lindex', queueKey, -1)
local ttl
if last and last ~= me then
	ttl = tonumber(redis.call('zscore', deadlineKey, last)) - now
else
	ttl = redis.call('pttl', lockKey)
end
redis.call('zadd', deadlineKey, now + ttl + allowance, me)
redis.call('rpush', queueKey, me)
return ttl
`
	// fairForeignRelease: KEYS[1] lock, KEYS[2] queue, KEYS[3] deadlines,
	// KEYS[4] channel prefix; ARGV[1] message, ARGV[2] lease ms, ARGV[3] owner,
	// ARGV[4] now ms. Reply: nil not the owner, 0 still held, 1 released.
	fairForeignRelease = `
local lockKey, queueKey, deadlineKey, prefix = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = tonumber(ARGV[4])
local first = redis.call('lindex', queueKey, 0)
while first do
	local due = redis.call('zscore', deadlineKey, first)
	if due and tonumber(due) > now then
		break
	end
	redis.call('lpop', queueKey)
	redis.call('zrem', deadlineKey, first)
	first = redis.call('lindex', queueKey, 0)
end
local function notify()
	if first then
		redis.call('publish', prefix .. ':' .. first, ARGV[1])
	end
end
if redis.call('exists', lockKey) == 0 then
	notify()
	return 1
end
if redis.call('hexists', lockKey, ARGV[3]) == 0 then
	return nil
end
if redis.call('hincrby', lockKey, ARGV[3], -1) > 0 then
	redis.call('pexpire', lockKey, ARGV[2])
	return 0
end
redis.call('del', lockKey)
notify()
return 1
`
)

// fairForeign is the foreign client: a Redisson-like owner "<uuid>:1" with its own
// wait allowance.
type fairForeign struct {
	srv   *testredis.Server
	owner string
	wait  time.Duration
}

func newFairForeign(t *testing.T, srv *testredis.Server, wait time.Duration) *fairForeign {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	h := hex.EncodeToString(b)
	return &fairForeign{srv: srv, wait: wait,
		owner: h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:] + ":1"}
}

func (f *fairForeign) now() string { return strconv.FormatInt(time.Now().UnixMilli(), 10) }

// acquire runs the acquire script: "" when held, else the wait in ms as text.
func (f *fairForeign) acquire(t *testing.T, name string, lease time.Duration) string {
	t.Helper()
	return do(t, f.srv, "EVAL", fairForeignAcquire, "3", name, fairQueueKey(name), fairTimeoutKey(name),
		strconv.FormatInt(lease.Milliseconds(), 10), f.owner, strconv.FormatInt(f.wait.Milliseconds(), 10), f.now())
}

// release runs the release script.
func (f *fairForeign) release(t *testing.T, name string, lease time.Duration) string {
	t.Helper()
	return do(t, f.srv, "EVAL", fairForeignRelease, "4", name, fairQueueKey(name), fairTimeoutKey(name), fairChannel(name),
		"0", strconv.FormatInt(lease.Milliseconds(), 10), f.owner, f.now())
}

// listen subscribes (a plain SUBSCRIBE on its own connection) to the foreign
// owner's channel and returns its messages. The subscription is active on return
// and ends with the test.
func (f *fairForeign) listen(t *testing.T, name string) <-chan string {
	t.Helper()
	ch := fairChannel(name) + ":" + f.owner
	rc, err := rueidis.NewClient(rueidis.ClientOption{InitAddress: []string{f.srv.Addr()}, DisableCache: true})
	if err != nil {
		t.Fatal(err)
	}
	msgs := make(chan string, 16)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		rc.Receive(ctx, rc.B().Subscribe().Channel(ch).Build(), func(m rueidis.PubSubMessage) {
			select {
			case msgs <- m.Message:
			default:
			}
		})
	}()
	t.Cleanup(func() {
		cancel()
		<-done
		rc.Close()
	})
	fairWaitFor(t, 5*time.Second, "the foreign subscription", func() bool {
		return do(t, f.srv, "PUBSUB", "NUMSUB", ch) == ch+"\n1"
	})
	return msgs
}

// TestFairInteropForeignRedisson: leash holds a fair lock; a foreign Redisson
// client queues (gets a TTL), and a second leash waiter queues behind it. The leash
// holder's Unlock wakes the foreign client on its own channel (and not the leash
// waiter), whose acquire then succeeds; the foreign release wakes the leash waiter
// on its channel, which gets the lock at once. Order: holder, foreign, waiter.
func TestFairInteropForeignRedisson(t *testing.T) {
	srv := testredis.New(t)
	name := fairName(t, "")
	order := name + ":order"
	const allowance = 5 * time.Minute
	c := newClient(t, srv, lockapi.Options{FairWaitTimeout: allowance})
	foreign := newFairForeign(t, srv, allowance)
	notes := foreign.listen(t, name)

	holder := c.FairMutex(name)
	if err := holder.Lock(fairCtx(t, 5*time.Second)); err != nil {
		t.Fatalf("holder Lock: %v", err)
	}
	do(t, srv, "RPUSH", order, "leash-holder")

	ttlText := foreign.acquire(t, name, 30*time.Second)
	ttl, err := strconv.ParseInt(ttlText, 10, 64)
	if err != nil || ttl <= 0 || ttl > lockapi.DefaultWatchdogTimeout.Milliseconds() {
		t.Fatalf("foreign acquire while leash holds = %q, want the lock's PTTL (0, 30000]", ttlText)
	}
	if q := fairList(t, srv, fairQueueKey(name)); !slices.Equal(q, []string{foreign.owner}) {
		t.Fatalf("queue after the foreign client queued = %q", q)
	}

	waiter := c.FairMutex(name)
	got, waiterField := fairEnqueue(t, srv, waiter, fairCtx(t, 30*time.Second), 2)
	if waiterField == foreign.owner {
		t.Fatalf("the leash waiter is not in the queue: %q", fairList(t, srv, fairQueueKey(name)))
	}
	// The waiter's deadline is the foreign one's plus the allowance.
	fd, _ := fairScore(t, srv, fairTimeoutKey(name), foreign.owner)
	wd, ok := fairScore(t, srv, fairTimeoutKey(name), waiterField)
	if !ok || wd-fd < allowance.Milliseconds()-100 || wd-fd > allowance.Milliseconds()+100 {
		t.Errorf("deadlines: foreign %d, leash waiter %d (present %v): want the waiter's %v later", fd, wd, ok, allowance)
	}

	unlock(t, holder)
	select {
	case msg := <-notes:
		if msg != "0" {
			t.Errorf("foreign client got %q on its channel, want \"0\"", msg)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the foreign client was not notified on its channel after the leash holder's Unlock")
	}
	if r := foreign.acquire(t, name, 30*time.Second); r != "" {
		t.Fatalf("foreign acquire after the notice = %q, want nil (held); queue %q, hash %q", r,
			fairList(t, srv, fairQueueKey(name)), do(t, srv, "HGETALL", name))
	}
	do(t, srv, "RPUSH", order, "foreign")
	if still, err := fairStillWaiting(got, 200*time.Millisecond); !still {
		t.Fatalf("the leash waiter's Lock returned %v while the foreign client holds the lock", err)
	}
	if q := fairList(t, srv, fairQueueKey(name)); !slices.Equal(q, []string{waiterField}) {
		t.Errorf("queue while the foreign client holds = %q, want only the leash waiter", q)
	}
	// The foreign acquisition moved the waiter up: its deadline dropped by one allowance.
	if wd2, _ := fairScore(t, srv, fairTimeoutKey(name), waiterField); wd-wd2 != allowance.Milliseconds() {
		t.Errorf("leash waiter's deadline went from %d to %d, want a drop of %v", wd, wd2, allowance)
	}

	released := time.Now()
	if r := foreign.release(t, name, 30*time.Second); r != "1" {
		t.Fatalf("foreign release = %q, want 1", r)
	}
	err, ok = fairRecv(got, 3*time.Second)
	if !ok {
		t.Fatalf("the leash waiter did not get the lock within 3s of the foreign release (its retry timer is minutes away: the notice on its channel was missed)")
	}
	if err != nil {
		t.Fatalf("leash waiter Lock: %v", err)
	}
	wake := time.Since(released)
	do(t, srv, "RPUSH", order, "leash-waiter")
	if hk := do(t, srv, "HKEYS", name); hk != waiterField {
		t.Errorf("lock hash fields = %q, want the waiter's %q", hk, waiterField)
	}
	unlock(t, waiter)

	if o := fairList(t, srv, order); !slices.Equal(o, []string{"leash-holder", "foreign", "leash-waiter"}) {
		t.Errorf("order of acquisition = %q", o)
	}
	t.Logf("leash waiter got the lock %v after the foreign release", wake)
	fairMustBeClean(t, srv, name)
}
