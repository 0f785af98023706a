; Device scaling kernels of fh-transport's `cuda` feature: buf[i] *= factor, grid-stride loop.
; Compiled to scale.ptx (committed; loaded at run time, no nvcc needed) with:
;   opt-14 -O3 scale.ll | llc-14 -O3 -march=nvptx64 -mcpu=sm_60 -mattr=+ptx60 -o scale.ptx
; f16 and bf16 are multiplied in f32 (as fh_core::kernels::scale does); bf16 rounds to nearest
; even in integer arithmetic so that the PTX needs no sm_80 instruction.
target datalayout = "e-i64:64-i128:128-v16:16-v32:32-n16:32:64"
target triple = "nvptx64-nvidia-cuda"

declare i32 @llvm.nvvm.read.ptx.sreg.tid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.ntid.x()
declare i32 @llvm.nvvm.read.ptx.sreg.nctaid.x()

define internal i64 @start() {
  %tid = call i32 @llvm.nvvm.read.ptx.sreg.tid.x()
  %bid = call i32 @llvm.nvvm.read.ptx.sreg.ctaid.x()
  %bdim = call i32 @llvm.nvvm.read.ptx.sreg.ntid.x()
  %t = zext i32 %tid to i64
  %b = zext i32 %bid to i64
  %d = zext i32 %bdim to i64
  %bd = mul i64 %b, %d
  %s = add i64 %bd, %t
  ret i64 %s
}

define internal i64 @stride() {
  %bdim = call i32 @llvm.nvvm.read.ptx.sreg.ntid.x()
  %gdim = call i32 @llvm.nvvm.read.ptx.sreg.nctaid.x()
  %d = zext i32 %bdim to i64
  %g = zext i32 %gdim to i64
  %s = mul i64 %d, %g
  ret i64 %s
}

define void @fh_scale_f32(float* %p, i64 %n, float %f) {
entry:
  %s0 = call i64 @start()
  %st = call i64 @stride()
  br label %check
check:
  %i = phi i64 [ %s0, %entry ], [ %next, %body ]
  %c = icmp ult i64 %i, %n
  br i1 %c, label %body, label %exit
body:
  %a = getelementptr float, float* %p, i64 %i
  %v = load float, float* %a
  %m = fmul float %v, %f
  store float %m, float* %a
  %next = add i64 %i, %st
  br label %check
exit:
  ret void
}

define void @fh_scale_f64(double* %p, i64 %n, double %f) {
entry:
  %s0 = call i64 @start()
  %st = call i64 @stride()
  br label %check
check:
  %i = phi i64 [ %s0, %entry ], [ %next, %body ]
  %c = icmp ult i64 %i, %n
  br i1 %c, label %body, label %exit
body:
  %a = getelementptr double, double* %p, i64 %i
  %v = load double, double* %a
  %m = fmul double %v, %f
  store double %m, double* %a
  %next = add i64 %i, %st
  br label %check
exit:
  ret void
}

define void @fh_scale_f16(half* %p, i64 %n, float %f) {
entry:
  %s0 = call i64 @start()
  %st = call i64 @stride()
  br label %check
check:
  %i = phi i64 [ %s0, %entry ], [ %next, %body ]
  %c = icmp ult i64 %i, %n
  br i1 %c, label %body, label %exit
body:
  %a = getelementptr half, half* %p, i64 %i
  %h = load half, half* %a
  %v = fpext half %h to float
  %m = fmul float %v, %f
  %r = fptrunc float %m to half
  store half %r, half* %a
  %next = add i64 %i, %st
  br label %check
exit:
  ret void
}

define void @fh_scale_bf16(i16* %p, i64 %n, float %f) {
entry:
  %s0 = call i64 @start()
  %st = call i64 @stride()
  br label %check
check:
  %i = phi i64 [ %s0, %entry ], [ %next, %body ]
  %c = icmp ult i64 %i, %n
  br i1 %c, label %body, label %exit
body:
  %a = getelementptr i16, i16* %p, i64 %i
  %h = load i16, i16* %a
  %w = zext i16 %h to i32
  %u = shl i32 %w, 16
  %v = bitcast i32 %u to float
  %m = fmul float %v, %f
  %mb = bitcast float %m to i32
  ; round to nearest even: add 0x7fff + lsb of the kept half, then keep the high 16 bits
  %hi = lshr i32 %mb, 16
  %lsb = and i32 %hi, 1
  %bias = add i32 %lsb, 32767
  %rounded = add i32 %mb, %bias
  %rhi = lshr i32 %rounded, 16
  ; NaN stays a (quiet) NaN instead of rounding into infinity
  %nan = fcmp uno float %m, %m
  %qnan = or i32 %hi, 64
  %res = select i1 %nan, i32 %qnan, i32 %rhi
  %t = trunc i32 %res to i16
  store i16 %t, i16* %a
  %next = add i64 %i, %st
  br label %check
exit:
  ret void
}

!nvvm.annotations = !{!0, !1, !2, !3}
!0 = !{void (float*, i64, float)* @fh_scale_f32, !"kernel", i32 1}
!1 = !{void (double*, i64, double)* @fh_scale_f64, !"kernel", i32 1}
!2 = !{void (half*, i64, float)* @fh_scale_f16, !"kernel", i32 1}
!3 = !{void (i16*, i64, float)* @fh_scale_bf16, !"kernel", i32 1}
