package scripts

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"

	"github.com/redis/rueidis"
)

// ID names one script.
type ID uint8

// The scripts, one per file. The fair_*.lua scripts start with fair_lib.lua's
// shared functions.
const (
	LockAcquire      ID = iota // lock_acquire.lua
	LockRelease                // lock_release.lua
	LockReleaseOwner           // lock_release_owner.lua
	LockForceRelease           // lock_force_release.lua
	LockRenew                  // lock_renew.lua
	LockHandoff                // lock_handoff.lua
	FairAcquire                // fair_acquire.lua
	FairRelease                // fair_release.lua
	FairLeave                  // fair_leave.lua
	FairHandoff                // fair_handoff.lua
	FairForceRelease           // fair_force_release.lua
	numScripts
)

var (
	//go:embed lock_acquire.lua
	lockAcquireSrc string
	//go:embed lock_release.lua
	lockReleaseSrc string
	//go:embed lock_release_owner.lua
	lockReleaseOwnerSrc string
	//go:embed lock_force_release.lua
	lockForceReleaseSrc string
	//go:embed lock_renew.lua
	lockRenewSrc string
	//go:embed lock_handoff.lua
	lockHandoffSrc string
	//go:embed fair_lib.lua
	fairLibSrc string
	//go:embed fair_acquire.lua
	fairAcquireSrc string
	//go:embed fair_release.lua
	fairReleaseSrc string
	//go:embed fair_leave.lua
	fairLeaveSrc string
	//go:embed fair_handoff.lua
	fairHandoffSrc string
	//go:embed fair_force_release.lua
	fairForceReleaseSrc string
)

var sources = [numScripts]string{
	LockAcquire:      lockAcquireSrc,
	LockRelease:      lockReleaseSrc,
	LockReleaseOwner: lockReleaseOwnerSrc,
	LockForceRelease: lockForceReleaseSrc,
	LockRenew:        lockRenewSrc,
	LockHandoff:      lockHandoffSrc,
	FairAcquire:      fairLibSrc + fairAcquireSrc,
	FairRelease:      fairLibSrc + fairReleaseSrc,
	FairLeave:        fairLibSrc + fairLeaveSrc,
	FairHandoff:      fairLibSrc + fairHandoffSrc,
	FairForceRelease: fairLibSrc + fairForceReleaseSrc,
}

var names = [numScripts]string{
	LockAcquire:      "lock_acquire",
	LockRelease:      "lock_release",
	LockReleaseOwner: "lock_release_owner",
	LockForceRelease: "lock_force_release",
	LockRenew:        "lock_renew",
	LockHandoff:      "lock_handoff",
	FairAcquire:      "fair_acquire",
	FairRelease:      "fair_release",
	FairLeave:        "fair_leave",
	FairHandoff:      "fair_handoff",
	FairForceRelease: "fair_force_release",
}

// String returns the script's file name without its extension.
func (id ID) String() string {
	if id < numScripts {
		return names[id]
	}
	return fmt.Sprintf("script(%d)", uint8(id))
}

// Source returns the script's Lua text, for tests and tools.
func Source(id ID) string { return sources[id] }

// Reply is a script's reply decoded into the three shapes leash's scripts return:
// a Redis nil, an integer, or an array of integers.
type Reply struct {
	Nil  bool
	Int  int64
	Ints []int64
}

// Runner runs scripts. The engine depends on this interface so its tests can use a
// fake; Redis is the production implementation.
type Runner interface {
	// Run executes the script and decodes its reply. Errors are Redis error replies
	// (as *rueidis.RedisError, matched with rueidis.IsRedisErr) or transport errors.
	Run(ctx context.Context, id ID, keys, args []string) (Reply, error)
}

// Call is one script call of a batch.
type Call struct {
	ID         ID
	Keys, Args []string
}

// Result is one call's outcome.
type Result struct {
	Reply Reply
	Err   error
}

// BatchRunner is a Runner that can also send many calls in one write. The engine
// uses it, when available, to send the calls one step of its loop produced together.
type BatchRunner interface {
	Runner
	// RunBatch runs calls and returns their results in the same order.
	RunBatch(ctx context.Context, calls []Call) []Result
}

// Redis runs the scripts on a rueidis client.
type Redis struct {
	client  rueidis.Client
	scripts [numScripts]*rueidis.Lua
	shas    [numScripts]string
}

var _ BatchRunner = (*Redis)(nil)

// NewRedis returns a Runner over client. SHAs are computed from the embedded sources;
// nothing is sent until the first call.
func NewRedis(client rueidis.Client) *Redis {
	r := &Redis{client: client}
	for i, src := range sources {
		r.scripts[i] = rueidis.NewLuaScript(src)
		sum := sha1.Sum([]byte(src))
		r.shas[i] = hex.EncodeToString(sum[:])
	}
	return r
}

// ErrReordered is a call's result when the server did not run it (NOSCRIPT) and a
// later call of the same batch on one of its keys did run: sending it again now
// would run the two in the wrong order. Nothing ran, so the caller may retry it,
// as after a transport error.
var ErrReordered = errors.New("leash: script not loaded when sent; a later call on the same lock already ran")

// RunBatch implements BatchRunner: one pipelined write of EVALSHA calls. When the
// server answers NOSCRIPT (its script cache was flushed, or it restarted), every
// script is loaded again, and the calls that did not run are sent again, in order,
// unless a later call on one of their keys already ran (see ErrReordered).
func (r *Redis) RunBatch(ctx context.Context, calls []Call) []Result {
	c := r.client
	cmds := make(rueidis.Commands, len(calls))
	for i, call := range calls {
		cmds[i] = r.evalsha(call)
	}
	out := make([]Result, len(calls))
	var missed []int
	for i, res := range c.DoMulti(ctx, cmds...) {
		if e, ok := rueidis.IsRedisErr(res.Error()); ok && e.IsNoScript() {
			missed = append(missed, i)
			continue
		}
		out[i] = result(res)
	}
	if len(missed) == 0 {
		return out
	}
	if err := r.loadAll(ctx); err != nil {
		for _, i := range missed {
			out[i] = Result{Err: err}
		}
		return out
	}
	var again []int
	cmds = cmds[:0]
	for _, i := range missed {
		if overtaken(calls, missed, i) {
			out[i] = Result{Err: ErrReordered}
			continue
		}
		again = append(again, i)
		cmds = append(cmds, r.evalsha(calls[i]))
	}
	for j, res := range c.DoMulti(ctx, cmds...) {
		out[again[j]] = result(res)
	}
	return out
}

func (r *Redis) evalsha(call Call) rueidis.Completed {
	return r.client.B().Evalsha().Sha1(r.shas[call.ID]).Numkeys(int64(len(call.Keys))).Key(call.Keys...).Arg(call.Args...).Build()
}

// overtaken reports whether a call after calls[i] that did run (is not in missed)
// shares a key with it.
func overtaken(calls []Call, missed []int, i int) bool {
	for j := i + 1; j < len(calls); j++ {
		if slices.Contains(missed, j) {
			continue
		}
		for _, k := range calls[j].Keys {
			if slices.Contains(calls[i].Keys, k) {
				return true
			}
		}
	}
	return false
}

// loadAll loads every script into the server's cache, in one write, so a flushed
// cache is refilled whole rather than script by script.
func (r *Redis) loadAll(ctx context.Context) error {
	c := r.client
	cmds := make(rueidis.Commands, 0, numScripts)
	for _, src := range sources {
		cmds = append(cmds, c.B().ScriptLoad().Script(src).Build())
	}
	for _, res := range c.DoMulti(ctx, cmds...) {
		if err := res.Error(); err != nil {
			return err
		}
	}
	return nil
}

func result(res rueidis.RedisResult) Result {
	msg, err := res.ToMessage()
	if err != nil {
		if rueidis.IsRedisNil(err) {
			return Result{Reply: Reply{Nil: true}}
		}
		return Result{Err: err}
	}
	reply, err := decode(msg)
	return Result{Reply: reply, Err: err}
}

// Run implements Runner.
func (r *Redis) Run(ctx context.Context, id ID, keys, args []string) (Reply, error) {
	msg, err := r.scripts[id].Exec(ctx, r.client, keys, args).ToMessage()
	if err != nil {
		if rueidis.IsRedisNil(err) {
			return Reply{Nil: true}, nil
		}
		return Reply{}, err
	}
	return decode(msg)
}

func decode(msg rueidis.RedisMessage) (Reply, error) {
	if msg.IsNil() {
		return Reply{Nil: true}, nil
	}
	if n, err := msg.AsInt64(); err == nil {
		return Reply{Int: n}, nil
	}
	arr, err := msg.ToArray()
	if err != nil {
		return Reply{}, errors.New("leash: unexpected script reply: " + msg.String())
	}
	ints := make([]int64, len(arr))
	for i, m := range arr {
		if ints[i], err = m.AsInt64(); err != nil {
			return Reply{}, errors.New("leash: unexpected script reply element: " + m.String())
		}
	}
	return Reply{Ints: ints}, nil
}

// NumScripts is how many scripts the package holds (for tests and tools).
const NumScripts = int(numScripts)
